"""Plumbing for 06's mixed precision: torch.amp.GradScaler's state format.

06's DynamicLossScaler makes GradScaler's decisions; what it inherits from here only
lets a checkpoint written by either load into the other.
"""

import torch


def fp32(x: float) -> float:
    """Round a Python float (a double) to fp32: GradScaler keeps its scale in fp32."""
    return torch.tensor(x, dtype=torch.float32).item()


class GradScalerState:
    """GradScaler's public getters and state_dict keys ("scale" is our _scale), so
    either scaler loads the other's checkpoint. The subclass sets enabled, _scale,
    _growth_factor, _backoff_factor, _growth_interval and _growth_tracker."""

    KEYS = "scale growth_factor backoff_factor growth_interval _growth_tracker"

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        return {k: getattr(self, "_" + k.lstrip("_")) for k in self.KEYS.split()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self.enabled:
            return
        if not state_dict:
            raise RuntimeError("empty scaler state dict: saved from a disabled scaler?")
        self._scale = fp32(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])

