"""kvcap.tools — the calibration tools from Python: kvcap-calibrate (recorded datasets to a
calibration state) and kvcap-convert (states to a deployable artifact; --inspect any kvcap
file). They come with the package (``pip install ./python`` builds and bundles them), else from
the folder $KVCAP_TOOLS names (a build folder), else from PATH.

    import kvcap.tools
    state = kvcap.tools.calibrate("dataset/", "run.kvcs", config="model.calib.yaml")
    artifact = kvcap.tools.convert(["run.kvcs"], "model.kvcap", keys="uniform:0.4")
    print(kvcap.tools.inspect(artifact))
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

from kvcap import Error

__all__ = ["ToolError", "find", "run", "calibrate", "convert", "inspect"]

_BUNDLED = Path(__file__).resolve().parent / "bin"
PathLike = Union[str, "os.PathLike[str]"]


class ToolError(Error):
    """A tool exited with a failure: ``returncode`` (2: bad usage), and what it printed on
    stderr as ``message``."""

    def __init__(self, tool: str, returncode: int, stderr: str):
        super().__init__(1 if returncode == 2 else 3, stderr.strip() or f"{tool} failed")
        self.status_name = "USAGE" if returncode == 2 else "TOOL_FAILED"
        self.tool, self.returncode = tool, returncode
        self.args = (f"{tool} exited with {returncode}: {self.message}",)


def find(tool: str) -> str:
    """The path of `tool` ("kvcap-calibrate" or "kvcap-convert")."""
    if tool not in ("kvcap-calibrate", "kvcap-convert"):
        raise Error(1, f"tool: '{tool}' is not kvcap-calibrate or kvcap-convert")
    for folder in (os.environ.get("KVCAP_TOOLS"), _BUNDLED):
        if folder and (Path(folder) / tool).is_file():
            return str(Path(folder) / tool)
    found = shutil.which(tool)
    if found:
        return found
    raise Error(12, f"{tool}: not bundled with this package, not in $KVCAP_TOOLS and not on "
                "PATH")  # KVCAP_ERR_NOT_FOUND


def run(tool: str, *args: PathLike, timeout: Optional[float] = None
        ) -> "subprocess.CompletedProcess[str]":
    """Runs `tool` with `args`; its output comes back in the result, a failure raises
    :class:`ToolError` with what it printed on stderr, and each warning it printed is issued
    as a Python warning (UserWarning)."""
    r = subprocess.run([find(tool), *map(os.fspath, args)], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise ToolError(tool, r.returncode, r.stderr)
    tag = f"{tool}: warning: "
    for line in r.stderr.splitlines():
        if line.startswith(tag):
            warnings.warn(f"{tool}: {line[len(tag):]}", stacklevel=3)
    return r


def calibrate(data: Union[PathLike, Sequence[PathLike]], out: PathLike, *,
              config: Optional[PathLike] = None, device: str = "auto",
              metrics_json: Optional[PathLike] = None) -> Path:
    """kvcap-calibrate: the dataset shards or folders in `data` to the calibration state
    `out`, with the calibration config `config` (default: the tool's embedded one)."""
    folders = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    args: list = ["--out", out, "--quiet", "--device", device]
    if config is not None:
        args += ["--config", config]
    if metrics_json is not None:
        args += ["--metrics-json", metrics_json]
    for d in folders:
        args += ["--data", d]
    run("kvcap-calibrate", *args)
    return Path(out)


def convert(states: Union[PathLike, Sequence[PathLike]], out: PathLike, *,
            keys: Optional[str] = None, values: Optional[str] = None,
            storage: Optional[str] = None, fallback: Optional[str] = None,
            value_basis: Optional[str] = None) -> Path:
    """kvcap-convert: calibration states to the artifact `out`; ``keys`` and ``values`` are
    retention schedules ("uniform:0.4", "pyramid:0.6:0.2", "list:..."), ``storage`` f32, f16
    or bf16, ``fallback`` the policy for grids without a bucket, ``value_basis`` "calibrated"
    (default) or "dct". A value basis that keeps little more of the calibration values than
    random directions would is warned of (UserWarning)."""
    items = [states] if isinstance(states, (str, os.PathLike)) else list(states)
    args: list = [*items, "--out", out]
    for flag, value in (("--keys", keys), ("--values", values), ("--storage", storage),
                        ("--fallback", fallback), ("--value-basis", value_basis)):
        if value is not None:
            args += [flag, value]
    run("kvcap-convert", *args)
    return Path(out)


def inspect(path: PathLike) -> str:
    """kvcap-convert --inspect: kind, version, geometry, buckets, schedule and tensors of a
    kvcap file, validated (a file that is not valid raises ToolError)."""
    return run("kvcap-convert", "--inspect", path).stdout


def _exec(tool: str) -> None:
    path = find(tool)
    os.execv(path, [tool, *sys.argv[1:]])


def calibrate_main() -> None:
    """The console script kvcap-calibrate: the bundled tool with this command line."""
    _exec("kvcap-calibrate")


def convert_main() -> None:
    """The console script kvcap-convert: the bundled tool with this command line."""
    _exec("kvcap-convert")
