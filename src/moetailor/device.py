"""Where the offline verbs run a model's weights (``--device``): ``Placement`` is the only code that
moves weights and activations there, and it counts the bytes placed, so a streamed verb's device
memory is measured by the same code on CPU and GPU.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

SPREAD_SHARE = 0.9   # a model fits one GPU when its weights take at most this share of the free memory


def parse_device(text: str) -> str:
    """The spelling check ``--device`` applies while parsing (what torch sees is checked later)."""
    value = str(text).strip().lower()
    if value in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", value):
        return value
    raise ValueError(f"--device {text!r} is not a device; choose auto, cpu, cuda or cuda:N (N = a GPU index)")


def resolve_device(text: str | torch.device) -> torch.device:
    """``auto`` = the first GPU torch sees, else the CPU; ``cuda``/``cuda:N`` only where torch sees that
    GPU (a one-line error naming the fix otherwise)."""
    if isinstance(text, torch.device):
        return text
    value = parse_device(text)
    if value == "auto":
        return torch.device("cuda", 0) if gpu_count() else torch.device("cpu")
    if value == "cpu":
        return torch.device("cpu")
    index = int(value.partition(":")[2] or 0)
    n = gpu_count()
    if n == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"--device {value}: torch sees no GPU here (torch {torch.__version__}, {build}); use "
                         "--device cpu or auto, or run where torch.cuda.is_available() is true")
    if index >= n:
        raise ValueError(f"--device {value}: torch sees {n} GPU{'s' if n > 1 else ''} (cuda:0..cuda:{n - 1}); pick "
                         "one of them or --device auto (check CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", index)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_bytes(device: torch.device) -> int | None:
    """Memory free for weights on ``device`` now (CPU: MemAvailable), or None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    from .memory import available_gib

    free = available_gib()
    return None if free is None else int(free * 2**30)


def tensor_bytes(tensors) -> int:
    """Bytes of every tensor in a (nested) tuple/list/dict of tensors (anything else counts 0)."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (tuple, list)):
        return sum(tensor_bytes(t) for t in tensors)
    if isinstance(tensors, dict):
        return sum(tensor_bytes(t) for t in tensors.values())
    return 0


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors once)."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen and not t.is_meta:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def to_device(value, device: torch.device):
    """``value`` with every tensor in it (nested tuples/lists/dicts) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


@dataclass
class Placement:
    """Moves weights and activations onto ``device`` and counts the bytes placed there.
    ``resident``: weight bytes on the device now (a whole model, or the streamed layer); ``peak``: the
    most bytes placed at once (weights + the activations a step holds there)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    spread: bool = False         # a model too large for one GPU may go across all of them (accelerate)
    resident: int = 0
    peak: int = 0
    device_map: dict | None = None   # module name -> GPU, when accelerate spread the model

    @classmethod
    def of(cls, device: str | torch.device | None, spread: bool = False) -> "Placement":
        return cls(resolve_device("cpu" if device is None else device), spread)

    def _note(self, transient: int = 0) -> None:
        self.peak = max(self.peak, self.resident + transient)

    def model(self, model: nn.Module) -> nn.Module:
        """The whole model on the device. On a GPU whose free memory it does not fit, across every
        visible GPU (``device_map="auto"`` through accelerate) when ``spread``, accelerate is installed
        and there are several GPUs; otherwise a one-line error naming the fix."""
        need = module_bytes(model)
        if self.device.type == "cuda":
            free = free_bytes(self.device)
            if free is not None and need > SPREAD_SHARE * free:
                return self._spread(model, need, free)
        model.to(self.device)
        self.resident += need
        self._note()
        return model

    def _spread(self, model: nn.Module, need: int, free: int) -> nn.Module:
        gib = lambda b: f"{b / 2**30:.1f} GiB"   # noqa: E731
        where = f"the model's {gib(need)} of weights do not fit the {gib(free)} free on {self.device}"
        if not self.spread:
            raise ValueError(f"{where}, and this verb runs the whole model on one device; use a GPU with more free "
                             "memory, --device cpu, or a layer-streamed verb (calibrate, eval --metric kl, tune "
                             "--max-kl)")
        try:
            from accelerate import dispatch_model, infer_auto_device_map
        except ImportError:
            raise ValueError(f"{where}; install accelerate (pip install accelerate) to spread it over several GPUs, "
                             "or use --device cpu") from None
        if gpu_count() < 2:
            raise ValueError(f"{where} and torch sees one GPU; run where several GPUs are visible, or use --device "
                             "cpu") from None
        budget = {i: int(SPREAD_SHARE * torch.cuda.mem_get_info(i)[0]) for i in range(gpu_count())}
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split)
        if any(d in ("cpu", "disk") for d in device_map.values()):
            raise ValueError(f"{where}, and all {gpu_count()} GPUs together hold less than it; use a layer-streamed "
                             "verb (calibrate --stream on, eval --metric kl) or --device cpu")
        self.device_map = device_map
        self.resident += need
        self._note()
        return dispatch_model(model, device_map=device_map)

    def layer(self, module: nn.Module) -> nn.Module:
        """A streamed layer (materialised on the CPU) moved onto the device."""
        module.to(self.device)
        self.resident += module_bytes(module)
        self._note()
        return module

    @contextmanager
    def visiting(self, module: nn.Module):
        """A small module the host keeps (a skeleton's final norm) on the device for a while."""
        home = next(iter(module.parameters()), torch.empty(0)).device
        self.layer(module)
        try:
            yield module
        finally:
            self.resident -= module_bytes(module)
            module.to(home)

    def release(self, module: nn.Module) -> None:
        """A streamed layer leaves the device (its weights go back to the meta device)."""
        from .memory import free_module

        self.resident -= module_bytes(module)
        free_module(module)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def inputs(self, value):
        """Token ids, a batch's activations or a layer's inputs (nested) on the device; their bytes
        count towards the peak while the step that reads them runs (see ``step``)."""
        return to_device(value, self.device)

    def step(self, *held) -> None:
        """Record the peak of a step that holds ``held`` (its inputs and outputs) on the device beside
        the resident weights."""
        self._note(tensor_bytes(held))

    def device_peak_bytes(self) -> int:
        """The peak the device saw: on a GPU the allocator's own (intermediates included), else the
        bytes counted by this placement."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak
