"""A sweep's Tune state, signed by the driver that wrote it and verified before Tune restores (unpickles) it.

Tune restores an interrupted sweep from files it pickled: `tuner.pkl`, the cloudpickle inside its experiment state,
its searcher's state. Unpickling a planted one runs its code, and the sweep folder sits in the run's storage, which
others may write. So while a sweep runs, a Tune callback copies those files into `tune-state/` beside the
experiment after each of Tune's saves, with a list of their sha256 signed with the project's key (core/signing.py).
Before a restore, the list is verified and the verified copies replace every state file in the experiment folder,
so Tune reads only what this user's own driver wrote. A failed trial's pickled exception (error.pkl, in its folder)
is deleted as it is written and before a restore: its error.txt is read instead. A sweep folder whose state is not
signed with this machine's key is refused, with the way to start it over."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
from pathlib import Path

from ray.tune import Callback

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.signing import KEY_ENV, file_sha256, signed_list, signing_key, verified_list

TUNER_FILE = "tuner.pkl"
# every name Tune's restore reads state from (ray.tune: TuneController, the search algorithms, CallbackList)
STATE_FILES = (TUNER_FILE, "experiment_state-*.json", "basic-variant-state-*.json", "search_gen_state-*.json",
               "searcher-state-*.pkl", "callback-states-*.pkl")
EXPERIMENT_STATE = STATE_FILES[1]
ERROR_PICKLE = "error.pkl"  # a failed trial's exception, pickled, in its folder: never left to be read
SIGNED_DIR = "tune-state"
SIGNED_LIST = "signed.json"


def is_state_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in STATE_FILES)


def sign_state(sources: list[Path], folder: Path) -> None:
    """Copy `sources` into `folder` (each under its digest, so a copy is never rewritten in place) and replace the
    signed list last: a driver killed at any point leaves the list before or after, each with all its copies."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for source in sources:
        data = source.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        stored = folder / f"{digest[:16]}-{source.name}"
        if not stored.exists():
            partial = stored.with_name(f".{stored.name}.partial")
            partial.write_bytes(data)
            os.replace(partial, stored)
        files[source.name] = {"sha256": digest, "stored": stored.name}
    partial = folder / f".{SIGNED_LIST}.partial"
    partial.write_text(signed_list(files, signing_key()))
    os.replace(partial, folder / SIGNED_LIST)
    kept = {SIGNED_LIST} | {entry["stored"] for entry in files.values()}
    for old in folder.iterdir():
        if old.name not in kept and not old.name.startswith("."):
            old.unlink()


class SignTuneState(Callback):
    """After each of Tune's saves of the experiment state (to its driver staging folder, then uploaded to the
    experiment folder), sign what a restore would read. Pickled into `tuner.pkl` with the run's config: it holds no
    key, only what it last signed."""

    def __init__(self) -> None:
        self._signed: dict[str, tuple[int, int]] | None = None

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        self._sign(trials)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        """A failed trial's error is read from its error.txt, not unpickled from the error.pkl Tune writes beside
        it in the trial's folder, which no signature covers."""
        trial.run_metadata.pickled_error_filename = None
        for folder in (trial.local_path, trial.storage.trial_fs_path):
            if folder and (pickled := Path(folder) / ERROR_PICKLE).is_file():
                pickled.unlink()

    def on_experiment_end(self, trials: list, **info) -> None:
        self._sign(trials)  # after Tune's last save

    def _sign(self, trials: list) -> None:
        if not trials:
            return
        storage = trials[0].storage
        experiment, staging = Path(storage.experiment_fs_path), Path(storage.experiment_driver_staging_path)
        sources = [experiment / TUNER_FILE] + sorted(
            f for f in (staging.iterdir() if staging.is_dir() else ()) if f.is_file() and is_state_file(f.name))
        seen = {str(f): (stat.st_mtime_ns, stat.st_size) for f in sources for stat in [f.stat()]}
        if seen != self._signed:
            sign_state(sources, experiment.parent / SIGNED_DIR)
            self._signed = seen


def restore_signed_state(experiment: Path) -> bool:
    """Before Tune restores `experiment`: verify the signed list and put its copies in place of every state file in
    the experiment folder. False when there is nothing to restore (the driver stopped before Tune first saved its
    experiment state). Raises when the state is not signed with this machine's key or a copy does not match."""
    folder = experiment.parent / SIGNED_DIR
    start_over = f"remove {experiment} and {folder} to run the sweep from its start"
    listing = folder / SIGNED_LIST
    if not listing.is_file():
        raise AmaliaError(f"{experiment}: Tune's state of this sweep is not signed ({listing} is missing), so it is "
                          f"not restored: Tune unpickles it. Written by another program, or planted; {start_over}")
    files = verified_list(listing.read_text(errors="replace"), signing_key())
    if files is None:
        raise AmaliaError(f"{listing} is not signed with this machine's key ({KEY_ENV}): written with another key, "
                          f"or forged. Set {KEY_ENV} to the key the sweep ran with, or {start_over}")
    for name, entry in files.items():
        stored = folder / str(entry.get("stored", "")) if isinstance(entry, dict) else None
        if (not is_state_file(name) or Path(name).name != name or stored is None or stored.parent != folder
                or not stored.is_file() or file_sha256(stored) != entry.get("sha256")):
            raise AmaliaError(f"{listing}: the signed copy of {name!r} is missing or damaged; {start_over}")
    if not any(fnmatch.fnmatchcase(name, EXPERIMENT_STATE) for name in files):
        return False
    for old in experiment.iterdir():
        if is_state_file(old.name):
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    for pickled in experiment.glob(f"*/{ERROR_PICKLE}"):  # a trial's pickled error: its error.txt says the same
        pickled.unlink()
    for name, entry in files.items():
        shutil.copyfile(folder / entry["stored"], experiment / name)
    return True
