"""Durable run storage behind a pyarrow filesystem: `run.storage` is a local path or a URI — s3:// (AWS, or any
S3-compatible store such as MinIO or Ceph via `endpoint_override`), gs://, abfs://, hdfs://, file:// through pyarrow,
any other scheme through fsspec (its plugins: memory://, az://, …).

The run folder under `run.output_dir` is the working copy the stages read and write; `RunStore` mirrors each finished
stage to `<storage>/<run name>/` (the manifest last, so a manifest never names outputs that are not uploaded) and
pulls back what a fresh machine needs to skip or resume. Ray Train writes its checkpoints straight to the store."""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path

import pyarrow.fs as pafs

from amalia_ray.core.errors import AmaliaError

# schemes pyarrow opens itself; the rest go through fsspec
_PYARROW = {"s3": pafs.S3FileSystem, "gs": pafs.GcsFileSystem, "gcs": pafs.GcsFileSystem}


def open_filesystem(uri: str, options: dict | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or URI; `options` go to the filesystem's constructor (e.g.
    S3FileSystem's endpoint_override, region). Credentials belong in the environment, not in recipes."""
    options = dict(options or {})
    if "://" not in uri:
        if options:
            raise AmaliaError(f"storage_options {sorted(options)} given for a local path: {uri}")
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    scheme, rest = uri.split("://", 1)
    try:
        if scheme in _PYARROW:
            return _PYARROW[scheme](**options), rest.rstrip("/")
        if scheme == "file" or not options:
            try:
                fs, path = pafs.FileSystem.from_uri(uri)
                return fs, path.rstrip("/")
            except ValueError:  # pyarrow's ArrowInvalid: a scheme it does not know
                pass
        import fsspec

        inner = fsspec.filesystem(scheme, **options)
        return pafs.PyFileSystem(pafs.FSSpecHandler(inner)), inner._strip_protocol(uri).rstrip("/")
    except (TypeError, ValueError, ImportError, OSError) as e:
        raise AmaliaError(f"cannot open storage {uri!r}: {type(e).__name__}: {e}") from None


class RunStore:
    """`<storage>/<run name>/`: push a finished stage's files, pull what is missing locally."""

    def __init__(self, uri: str, options: dict | None, run_name: str):
        self.uri = uri.rstrip("/") + "/" + run_name
        self.fs, root = open_filesystem(uri, options)
        self.root = posixpath.join(root, run_name)

    def path(self, rel: str = "") -> str:
        """A path inside `self.fs` (for Ray Train's storage_path together with storage_filesystem=self.fs)."""
        return posixpath.join(self.root, rel) if rel else self.root

    def check(self) -> None:
        """Fail now, naming the store, if it cannot be listed or written (bad bucket, endpoint or credentials)."""
        try:
            self.fs.create_dir(self.root, recursive=True)
            probe = self.path(".amalia-write-probe")
            with self.fs.open_output_stream(probe) as f:
                f.write(b"ok")
            self.fs.delete_file(probe)
        except (OSError, ValueError) as e:
            raise AmaliaError(f"run.storage {self.uri!r} is not writable: {e}") from None

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def push(self, local: Path, rel: str, skip: tuple[str, ...] = ()) -> None:
        """Replace `rel` in the store with the local file or folder (minus the top-level entries in `skip`)."""
        try:
            self._push(local, self.path(rel), skip)
        except OSError as e:
            raise AmaliaError(f"storing {local} at {self.uri}/{rel} failed: {e}") from None

    def _push(self, local: Path, target: str, skip: tuple[str, ...]) -> None:
        if local.is_file():
            self.fs.create_dir(posixpath.dirname(target), recursive=True)
            pafs.copy_files(str(local), target, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)
            return
        self.fs.create_dir(target, recursive=True)
        for child in sorted(local.iterdir()):
            if child.name in skip or child.name.endswith(".tmp"):
                continue
            dest = posixpath.join(target, child.name)
            if child.is_dir():
                if self.fs.get_file_info(dest).type == pafs.FileType.Directory:
                    self.fs.delete_dir(dest)  # no stale files from an earlier attempt
                self.fs.create_dir(dest, recursive=True)
            pafs.copy_files(str(child), dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)

    def pull(self, rel: str, local: Path) -> bool:
        """Copy `rel` from the store to `local` (which must not exist); False (nothing written) when the store has
        no such entry. The copy is made beside it and renamed into place once whole: a pull cut short (a preempted
        job) leaves no partial folder that a later attempt, seeing it there, would take for the whole."""
        partial = local.with_name(f".{local.name}.pulling-{os.getpid()}")
        try:
            try:
                if not self._pull(rel, partial):
                    return False
                os.replace(partial, local)
            except OSError as e:
                if not (local.exists() and partial.exists()):
                    raise AmaliaError(f"fetching {self.uri}/{rel} failed: {e}") from None
                # whole, but another process renamed its own copy into place first (two stage jobs on one
                # shared filesystem): theirs is kept
            return True
        finally:
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
            elif partial.exists():
                partial.unlink()

    def _pull(self, rel: str, local: Path) -> bool:
        info = self.fs.get_file_info(self.path(rel))
        if info.type == pafs.FileType.NotFound:
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        if info.type == pafs.FileType.File:
            pafs.copy_files(self.path(rel), str(local), source_filesystem=self.fs,
                            destination_filesystem=pafs.LocalFileSystem())
            return True
        # file by file, each checked: a stored key with `..` in it must not write outside the run folder
        base = self.path(rel)
        for item in self.fs.get_file_info(pafs.FileSelector(base, recursive=True)):
            inner = posixpath.relpath(item.path, base)
            target = (local / inner).resolve()
            if inner.startswith("../") or posixpath.isabs(inner) or not target.is_relative_to(local.resolve()):
                raise AmaliaError(f"refusing {self.uri}/{rel}: its entry {item.path!r} would be written outside "
                                  f"{local}")
            if item.type == pafs.FileType.Directory:
                target.mkdir(parents=True, exist_ok=True)
            elif item.type == pafs.FileType.File:
                target.parent.mkdir(parents=True, exist_ok=True)
                pafs.copy_files(item.path, str(target), source_filesystem=self.fs,
                                destination_filesystem=pafs.LocalFileSystem())
        local.mkdir(parents=True, exist_ok=True)
        return True
