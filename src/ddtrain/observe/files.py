"""Files the tool writes: results records and saved models, always atomically.

Every file ends with the mode a plain ``open`` would give it (0o666 less the umask), not
the 0o600 of the temporary file it is written to; records are strict JSON: a NaN or
infinity (a diverged loss) is written as ``null``, never as the bare ``NaN`` that strict
parsers reject.
"""
from __future__ import annotations

import json
import math
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call ``write(tmp_path)`` then rename over ``path``: readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp made it 0o600; a shared report must stay readable
        _fsync(tmp)          # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(path.parent)      # and the rename itself survives a power cut
    return path


def umask() -> int:
    """The process's umask, read without changing it (os.umask would, briefly, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


def check_writable(path, field: str) -> None:
    """ConfigError naming setting ``field`` unless ``path`` can be created: its nearest existing parent is a
    writable directory."""
    if not path:
        return
    from ddtrain.errors import ConfigError
    target = Path(path)
    if target.is_dir():
        raise ConfigError(field, f"'{path}' is a directory; give a file name")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(field, f"'{path}': {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(field, f"'{path}': cannot write in {parent}")


def write_json(path, data: dict, *, what: str = "the results record") -> Path:
    """Write ``data`` as strict JSON: non-finite floats become null (see ``jsonable``).

    A write that fails (a full disk) is kept elsewhere with a warning naming where, so that the
    run goes on to save its model (``_or_rescue``); the old file, if any, stays as it was.
    """
    text = json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n"

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    try:
        return _or_rescue(path, write, what, None)
    except _Rescued as rescued:
        import sys
        print(f"ddtrain: warning: {rescued}", file=sys.stderr, flush=True)
        return rescued.path


def jsonable(value):
    """``value`` as plain JSON types; NaN and infinities (floats, numpy or tensor elements) become None."""
    if isinstance(value, float):  # numpy's float64 too
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return jsonable(value.tolist())
    if isinstance(value, (Path, torch.device, torch.dtype)):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return {k: jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def versions(backend: str | None, device: torch.device) -> dict:
    from ddtrain.version import __version__
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
        write = lambda tmp: save_file(state, tmp)  # noqa: E731
    else:
        write = lambda tmp: torch.save(state, tmp)  # noqa: E731
    try:
        return _or_rescue(path, write, "the trained model", "--save")
    except _Rescued as rescued:  # kept, but not where asked: the run did not do what it was told
        from ddtrain.errors import DDTrainError
        raise DDTrainError(str(rescued)) from None


class _Rescued(Exception):
    """Written elsewhere than asked (``path``); the message says why and where."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


def _or_rescue(path, write, what: str, flag: str | None) -> Path:
    """``atomic_write``, and when that fails (a full disk, a lost mount) the same bytes written elsewhere.

    Trained weights are the one thing a run cannot give back: they go to the system's temporary
    folder, then the working directory, and the error says where they are.
    """
    from ddtrain.errors import DDTrainError
    try:
        return atomic_write(path, write)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError ("enforce fail")
        why = _why(exc)
    target = Path(path)
    tried = []
    for folder in (Path(tempfile.gettempdir()), Path.cwd()):
        rescue = folder / f"ddtrain-rescued-{os.getpid()}-{target.name}"
        try:
            atomic_write(rescue, write)
        except (OSError, RuntimeError) as exc:
            tried.append(f"{rescue} ({_why(exc)})")
            continue
        named = f"{flag} {path}" if flag else str(path)
        raise _Rescued(f"{named}: could not write {what} ({why}); it was saved to {rescue} instead: "
                       f"move it where you want it (mv {rescue} {path})", rescue)
    raise DDTrainError(f"{f'{flag} ' if flag else ''}{path}: could not write {what} ({why}), nor anywhere else "
                       f"({'; '.join(tried)}); "
                       "it is lost unless --checkpoint-dir was given (its last checkpoint holds the final state)")


def _why(exc: BaseException) -> str:
    import errno as errno_
    if isinstance(exc, OSError) and exc.errno:
        return exc.strerror or errno_.errorcode.get(exc.errno, str(exc))
    text = str(exc)
    if "enforce fail" in text or "unexpected pos" in text or "file write failed" in text:
        return "the write failed, most likely a full disk"
    return (text.splitlines() or [type(exc).__name__])[0][:160]
