"""Zip files as Kaggle ships them (deflated), byte-identical for the same content: every member
gets one fixed timestamp and mode, so the same seed writes the same bytes."""
from __future__ import annotations

import pathlib
import zipfile
from typing import Mapping, Union

import pandas as pd

#: The timestamp of every member.
DATE = (2018, 1, 1, 0, 0, 0)


def zip_entry(name: str) -> zipfile.ZipInfo:
    """A deflated member ``name`` with the fixed timestamp and mode 0644."""
    info = zipfile.ZipInfo(name, date_time=DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def write_zip(path: pathlib.Path, files: Mapping[str, Union[bytes, str]], *,
              folders: bool = False) -> None:
    """Writes ``files`` (member name -> content; text as UTF-8) into the zip ``path`` in their
    order; ``folders``: an entry for each top-level folder first, as some of Kaggle's zips have."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        if folders:
            for name in sorted({n.split("/")[0] + "/" for n in files if "/" in n}):
                z.writestr(zipfile.ZipInfo(name, date_time=DATE), b"")
        for name, data in files.items():
            z.writestr(zip_entry(name), data.encode("utf-8") if isinstance(data, str) else data)


def zip_csv(path: pathlib.Path, name: str, df: pd.DataFrame, **to_csv) -> None:
    """Writes ``df`` (no index; ``to_csv``: pandas' options) as the one member ``name``."""
    write_zip(path, {name: df.to_csv(index=False, **to_csv)})
