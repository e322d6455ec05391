"""The predicted expert demand of the step being run, handed from vLLM's scheduler to the
layers in the worker.

With a ``path_predictor``, the plugin's scheduler (``schedule.token_scheduler``) predicts
the routes of the decode requests it schedules and attaches the step's demand to vLLM's
``SchedulerOutput`` (a plain dataclass, pickled to the workers with its attributes). A
wrap of the model runner's ``execute_model`` keeps it here for the layers of that step.
"""

from __future__ import annotations

from vllm_specexpert.phases import StepDemand

ATTRIBUTE = "specexpert_demand"
"""Name of the attribute on ``SchedulerOutput``."""

_current: StepDemand | None = None


def current() -> StepDemand | None:
    """The running step's demand (``None``: no prediction for it)."""
    return _current


def install_runner_hook() -> None:
    """Wrap vLLM's model runner so that every step's demand is kept here (idempotent;
    called in the worker when the first offloaded layer is built)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specexpert.plugins import wrap_once

    def wrap(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            global _current
            _current = getattr(scheduler_output, ATTRIBUTE, None)
            return original(self, scheduler_output, *args, **kwargs)
        return execute_model

    wrap_once(GPUModelRunner, "execute_model", wrap)
