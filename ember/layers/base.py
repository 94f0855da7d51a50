"""The base class of ember's layers: ``nn.Module`` with a call that goes straight to ``forward``.

torch's ``Module.__call__`` checks a dozen hook and tracing states on every call. A batch-1 decode step of the default
model makes about 300 module calls, and that dispatch measured 0.1-0.4 ms of a 5 ms step (2 threads, 2026-11-25,
toggled in one process). A layer with hooks registered on it, or with global module hooks set, still takes torch's
path, so hooks (calibration's input capture, a user's) run as they do on any module.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as _torch_module


class Layer(nn.Module):
    def __setattr__(self, name: str, value: Any) -> None:
        """Sublayers and parameters are registered as torch registers them, and also kept in the instance's
        ``__dict__``, so that ``self.qkv_proj`` is a plain attribute read instead of ``Module.__getattr__``'s search
        of three dicts (~340 such reads a decode step of the default model). Every change made through attributes
        (reassigning, setting to None, deleting) keeps the two the same."""
        super().__setattr__(name, value)
        if isinstance(value, (nn.Module, nn.Parameter)):
            self.__dict__[name] = value
        elif name in self.__dict__.get("_modules", ()) or name in self.__dict__.get("_parameters", ()):
            self.__dict__.pop(name, None)  # None in a registered slot: Module.__getattr__ answers from the registry

    def __delattr__(self, name: str) -> None:
        registered = name in self._modules or name in self._parameters
        super().__delattr__(name)
        if registered:
            self.__dict__.pop(name, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (self._forward_pre_hooks or self._forward_hooks or _torch_module._global_forward_pre_hooks
                or _torch_module._global_forward_hooks):
            return nn.Module.__call__(self, *args, **kwargs)
        return self.forward(*args, **kwargs)
