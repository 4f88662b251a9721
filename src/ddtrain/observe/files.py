"""Files the tool writes: results records and saved models, always atomically."""
from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

import torch


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call ``write(tmp_path)`` then rename over ``path``: readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        _fsync(tmp)          # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(path.parent)      # and the rename itself survives a power cut
    return path


def _fsync(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def check_writable(path, flag: str) -> None:
    """Raise DDTrainError unless ``path`` can be created: its nearest existing parent is a writable directory."""
    if not path:
        return
    from ddtrain.errors import DDTrainError
    target = Path(path)
    if target.is_dir():
        raise DDTrainError(f"{flag} {path!r} is a directory; give a file name")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise DDTrainError(f"{flag} {path!r}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DDTrainError(f"{flag} {path!r}: cannot write in {parent}")


def write_json(path, data: dict) -> Path:
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=_jsonable)
            f.write("\n")
    return atomic_write(path, write)


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (Path, torch.device, torch.dtype)):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def versions(backend: str | None, device: torch.device) -> dict:
    from ddtrain import __version__
    info = {"ddtrain": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "backend": backend or "none", "device": str(device)}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def save_model(module: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Save the state dict: ``.safetensors`` via safetensors, anything else via torch.save.

    Both load without executing code: ``torch.load(path, weights_only=True)`` or
    ``safetensors.torch.load_file(path)``.
    """
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    if str(path).endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            from ddtrain.errors import DDTrainError
            raise DDTrainError("saving .safetensors needs the safetensors package: "
                               "pip install 'ddtrain[safetensors]' (or save to a .pt file)") from None
        return atomic_write(path, lambda tmp: save_file(state, tmp))
    return atomic_write(path, lambda tmp: torch.save(state, tmp))
