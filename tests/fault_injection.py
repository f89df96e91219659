"""Faults injected into Ray Train workers by the tests (pickled by value into the workers, so nothing here needs to
be importable there): a storage that fills up half way through writing a checkpoint."""

from __future__ import annotations

import errno


def train_loop_with_full_storage_at(config: dict, fail_at_upload: int) -> None:
    """The real training loop, except that the `fail_at_upload`-th checkpoint upload to the run's storage copies
    one file and then fails as a full disk does."""
    from pathlib import Path

    import pyarrow.fs
    from ray.train.v2._internal.execution import storage

    from amalia_ray.train.loop import train_loop

    real = storage._pyarrow_fs_copy_files
    uploads = []

    def copy_files(source, destination, source_filesystem=None, destination_filesystem=None, **kw):
        if destination_filesystem is None or not Path(source).is_dir():  # downloads and single files pass
            return real(source, destination, source_filesystem=source_filesystem,
                        destination_filesystem=destination_filesystem, **kw)
        uploads.append(destination)
        if len(uploads) == fail_at_upload:
            first = sorted(Path(source).iterdir())[0]
            destination_filesystem.create_dir(destination, recursive=True)
            pyarrow.fs.copy_files(str(first), f"{destination}/{first.name}",
                                  destination_filesystem=destination_filesystem)
            raise OSError(errno.ENOSPC, "No space left on device", destination)
        return real(source, destination, source_filesystem=source_filesystem,
                    destination_filesystem=destination_filesystem, **kw)

    storage._pyarrow_fs_copy_files = copy_files
    train_loop(config)


def full_storage_at(upload: int):
    """A train function (what TorchTrainer takes) whose `upload`-th checkpoint upload fails half way."""

    def train_loop(config: dict) -> None:
        train_loop_with_full_storage_at(config, upload)

    return train_loop
