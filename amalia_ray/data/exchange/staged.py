"""Documents between the data stage's passes, on the run's storage instead of Ray's object store.

A pass that looks across documents (one capture per page, site boilerplate, exact and near duplicates) needs the
whole corpus to exist before it decides, and the next pass reads it again. Held in the object store, a corpus larger
than the store spills to the node's local disk and is restored for every later pass, uncompressed; several passes in
flight hold several copies. Staged, each pass writes its documents once as Parquet files (one per block,
compressed, in row groups of ROW_GROUP_ROWS), and every later step reads them back inside its own task, a file or a
few row groups at a time: the object store holds only what is in flight and the key rows the decisions are taken on.

A `StagedFile` stands where a block reference would (`partitions.as_table` reads it), so the exchanges, `decide` and
`map_blocks` run over staged documents unchanged; `columns` reads only the columns a step needs (the keys of a
decision, the ids of a uniqueness check). The files are named and listed by the tasks that write them, never by
listing a folder (a shared filesystem may not show a file another node just wrote)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property

import pyarrow as pa
import pyarrow.parquet as pq

# rows per row group of a staged file: the unit a slice task reads (MinHash hashes 8,192 documents a task)
ROW_GROUP_ROWS = 8_192


@dataclass(frozen=True)
class StagedFile:
    """One staged block: its Parquet file, its rows and uncompressed bytes, and the columns a task reads (None:
    all)."""
    path: str
    rows: int
    nbytes: int
    columns: tuple[str, ...] | None = None

    def read(self, start: int = 0, rows: int | None = None) -> pa.Table:
        """Rows [start, start + rows) (all: None), reading only the row groups that hold them."""
        columns = list(self.columns) if self.columns is not None else None
        if start == 0 and (rows is None or rows >= self.rows):
            return pq.read_table(self.path, columns=columns)
        file = pq.ParquetFile(self.path)
        end = self.rows if rows is None else min(self.rows, start + rows)
        groups, first, at = [], None, 0
        for i in range(file.metadata.num_row_groups):
            n = file.metadata.row_group(i).num_rows
            if at + n > start and at < end:
                groups.append(i)
                first = at if first is None else first
            at += n
        if not groups:
            return file.schema_arrow.empty_table().select(columns) if columns else file.schema_arrow.empty_table()
        table = file.read_row_groups(groups, columns=columns)
        return table.slice(start - first, end - start)

    def batches(self) -> Iterator[pa.Table]:
        """The file a row group at a time."""
        file = pq.ParquetFile(self.path)
        columns = list(self.columns) if self.columns is not None else None
        for i in range(file.metadata.num_row_groups):
            yield file.read_row_group(i, columns=columns)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The table with the schema's columns in its order and types (a column it lacks: all null)."""
    return pa.table({f.name: table[f.name].cast(f.type) if f.name in table.column_names
                     else pa.nulls(len(table), f.type) for f in schema}, schema=schema)


def write_staged(table: pa.Table, path: str) -> StagedFile:
    """A block written as a staged file (in a task: the block never returns to the object store or the driver)."""
    pq.write_table(table, path, row_group_size=ROW_GROUP_ROWS)
    return StagedFile(path, table.num_rows, table.nbytes)


@dataclass(frozen=True)
class Staged:
    """A pass's documents as staged files, in order: the files are the blocks of every later step. `empty_schema`:
    the documents' schema when no file has rows (a pass that kept nothing)."""
    files: tuple[StagedFile, ...]
    empty_schema: pa.Schema | None = None

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    def select(self, columns: list[str]) -> Staged:
        """The same files, read for these columns only (their unified schema taken from this one's when it is
        known: a pass of many files would read every footer again for each selection)."""
        empty = self.empty_schema
        selected = Staged(tuple(replace(f, columns=tuple(columns)) for f in self.files),
                          pa.schema([empty.field(c) for c in columns]) if empty is not None else None)
        if self.files and "unified_schema" in self.__dict__:  # computed (cached_property keeps it there)
            unified = self.unified_schema
            selected.__dict__["unified_schema"] = pa.schema([unified.field(c) for c in columns
                                                              if c in unified.names])
        return selected

    @cached_property
    def unified_schema(self) -> pa.Schema:
        """Every file's schema unified (a column null in one block and typed in another takes the type); each
        footer is read once per Staged, on the driver."""
        schemas = [pq.read_schema(f.path) for f in self.files]
        if self.files and self.files[0].columns is not None:
            schemas = [pa.schema([s.field(c) for c in self.files[0].columns if c in s.names]) for s in schemas]
        if not schemas:
            return self.empty_schema or pa.schema([])
        return pa.unify_schemas(schemas, promote_options="permissive")

    def dataset(self):
        """A Ray Data dataset of the documents, in file order: one read task per file, each yielding its row groups
        one at a time cast to the files' unified schema (streamed: no pass holds them all)."""
        import ray

        schema = self.unified_schema
        if not self.files:
            return ray.data.from_arrow(schema.empty_table())
        files = list(self.files)

        def read(batch: pa.Table) -> Iterator[pa.Table]:
            for index in batch["file"].to_pylist():
                for table in files[index].batches():
                    yield conform(table, schema)

        return ray.data.from_items([{"file": i} for i in range(len(files))], override_num_blocks=len(files)
                                   ).map_batches(read, batch_size=1, batch_format="pyarrow")
