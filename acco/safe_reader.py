"""DCP's file reader, with its pickled metadata read by an unpickler that only admits the
classes DCP's metadata is made of: loading a checkpoint never runs code from the file.
(Its own module, imported when a checkpoint is read: torch.distributed.checkpoint costs a
second to import, which a job that never checkpoints does not pay.)"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["SafeFileSystemReader"]


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader, with its pickled metadata read by an unpickler that only admits the
    classes DCP's metadata is made of."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, dcp.Metadata):
            raise ValueError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    _ALLOWED_BUILTINS = frozenset({"set", "frozenset", "dict", "list", "tuple", "slice", "complex"})

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch" and name in {"strided", "sparse_coo", "contiguous_format", "preserve_format"})
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in self._ALLOWED_BUILTINS)
            or (module == "pathlib" and name in {"PosixPath", "WindowsPath", "PurePosixPath"})
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")
        return super().find_class(module, name)
