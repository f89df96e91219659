"""Documents between the data stage's passes, on the run's storage instead of Ray's object store.

A pass that looks across documents (one capture per page, site boilerplate, exact and near duplicates) needs the
whole corpus to exist before it decides, and the next pass reads it again. Held in the object store, a corpus larger
than the store spills to the node's local disk and is restored for every later pass, uncompressed; several passes in
flight hold several copies. Staged, each pass writes its documents once as Parquet files (one per block, compressed),
and every later step reads them back a file at a time inside its own task: the object store holds only what is in
flight and the key rows the decisions are taken on.

A `StagedFile` stands where a block reference would (`partitions.as_table` reads it), so the exchanges, `decide` and
`map_blocks` run over staged documents unchanged; `columns` reads only the columns a step needs (the keys of a
decision, the ids of a uniqueness check)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


@dataclass(frozen=True)
class StagedFile:
    """One staged block: its Parquet file, its rows and uncompressed bytes, and the columns a task reads (None:
    all)."""
    path: str
    rows: int
    nbytes: int
    columns: tuple[str, ...] | None = None

    def read(self) -> pa.Table:
        return pq.read_table(self.path, columns=list(self.columns) if self.columns is not None else None)


@dataclass(frozen=True)
class Staged:
    """A pass's documents as staged files, in order: the files are the blocks of every later step."""
    files: tuple[StagedFile, ...]

    @classmethod
    def of(cls, folder: Path | str) -> Staged:
        """The Parquet files of a folder, in name order (`part-000000.parquet`, …, by write task)."""
        files = []
        for path in sorted(Path(folder).glob("*.parquet")):
            meta = pq.read_metadata(path)  # the footer only: rows, and bytes as they will be once read
            nbytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            files.append(StagedFile(str(path), meta.num_rows, nbytes))
        return cls(tuple(files))

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    def select(self, columns: list[str]) -> Staged:
        """The same files, read for these columns only."""
        return Staged(tuple(replace(f, columns=tuple(columns)) for f in self.files))

    def schema(self) -> pa.Schema:
        """Every file's schema unified (a column null in one block and typed in another takes the type)."""
        schemas = [pq.read_schema(f.path) for f in self.files]
        if self.files and self.files[0].columns is not None:
            schemas = [pa.schema([s.field(c) for c in self.files[0].columns]) for s in schemas]
        return pa.unify_schemas(schemas, promote_options="permissive") if schemas else pa.schema([])

    def dataset(self):
        """A Ray Data dataset reading the files lazily, in order (streamed: no pass holds them all)."""
        import ray

        if not self.files:
            return ray.data.from_arrow(pa.table({}))
        columns = list(self.files[0].columns) if self.files[0].columns is not None else None
        return ray.data.read_parquet([f.path for f in self.files], columns=columns, schema=self.schema(),
                                     partitioning=None)
