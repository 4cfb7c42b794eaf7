"""Crediting a profiled step's time to its components (``python -m minibatch profile``, whose module docstring,
``experiments.step_profile``, lists the components and what each one holds): ``record_function`` ranges around the
model's own modules and the engine's phases (:func:`labelled`), then every profiler event's self time summed per
component (:func:`breakdown`)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

COMPONENTS = ("embedding", "norms", "qkv_proj", "rotary_and_reshapes", "kv_write", "attention", "o_proj", "mlp",
              "logits", "sampling", "prepare_inputs", "schedule", "python_overhead", "other_ops")
MODULE_COMPONENTS = (("embed_tokens", "embedding"), ("wte", "embedding"), ("q_proj", "qkv_proj"),
                     ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"), ("qkv_proj", "qkv_proj"),
                     ("o_proj", "o_proj"), ("dense", "o_proj"), ("mlp", "mlp"), ("norm", "norms"),
                     ("self_attn", "rotary_and_reshapes"), ("lm_head", "logits"))
KV_WRITE_OPS = ("aten::index_copy_", "aten::index_put_", "aten::_index_put_impl_")
LABEL = "mb::"
KERNEL_LABEL = "minibatch::"  # the fused decode layer's ranges (kernels/cpu_decode_layer.cpp) are named by component


def component_of_module(name: str) -> str | None:
    """The component a module's name puts it in (its last dotted part), or None."""
    leaf = name.rsplit(".", 1)[-1]
    for key, component in MODULE_COMPONENTS:
        if leaf == key or (key == "norm" and "norm" in leaf):
            return component
    return None


@contextmanager
def labelled(model, engine):
    """Label every component of a step with a ``record_function`` range for the profiler (hooks and wrappers,
    all removed on exit)."""
    import minibatch.runner.model_runner as model_runner

    ranges: list = []

    def push(label):
        def hook(*_):
            ranges.append(torch.profiler.record_function(LABEL + label))
            ranges[-1].__enter__()
        return hook

    def pop(*_):
        ranges.pop().__exit__(None, None, None)

    def wrap(fn, label):
        def wrapped(*a, **k):
            with torch.profiler.record_function(LABEL + label):
                return fn(*a, **k)
        return wrapped

    with ExitStack() as stack:
        for name, module in model.named_modules():
            component = component_of_module(name)
            if component is not None:
                stack.callback(module.register_forward_pre_hook(push(component)).remove)
                stack.callback(module.register_forward_hook(pop).remove)
        backend, runner, scheduler = engine.executor.attention_backend, engine.executor, engine.scheduler
        for obj, attr, label in ((backend, "forward", "attention"), (runner.sampler, "sample_batch", "sampling"),
                                 (scheduler, "schedule", "schedule"), (model_runner, "build_packed_batch",
                                                                       "prepare_inputs")):
            original = getattr(obj, attr)
            setattr(obj, attr, wrap(original, label))
            stack.callback(lambda o=obj, a=attr, f=original: setattr(o, a, f) if o is model_runner
                           else delattr(o, a))
        yield


def breakdown(events, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per step of each component from a profiler's events (``experiments.step_profile``'s docstring): (host
    time, device time). Host time is the CPU's (on a GPU: issuing the kernels); device time is the kernels' own time
    on the GPU, credited to the op that launched them (all zeros on a CPU)."""
    host, device = dict.fromkeys(COMPONENTS, 0.0), dict.fromkeys(COMPONENTS, 0.0)

    def visit(event, component):
        if event.name.startswith(LABEL):
            component = event.name[len(LABEL):]
            # Python inside the range, no op: the scheduler's is its work (it runs no ops), the rest is overhead
            host["schedule" if component == "schedule" else "python_overhead"] += event.self_cpu_time_total / 1e6
        else:
            if event.name.startswith(KERNEL_LABEL) and event.name[len(KERNEL_LABEL):] in COMPONENTS:  # fused layer
                component = event.name[len(KERNEL_LABEL):]
            where = ("kv_write" if component == "attention" and event.name in KV_WRITE_OPS else component) \
                or "other_ops"
            host[where] += event.self_cpu_time_total / 1e6
            device[where] += getattr(event, "self_device_time_total", 0) / 1e6
        for child in event.cpu_children:
            visit(child, component)

    for event in events:  # the kernels themselves are events too: counted through the ops that launched them
        if event.cpu_parent is None and event.device_type == torch.autograd.DeviceType.CPU:
            visit(event, None)
    return {k: v / steps for k, v in host.items()}, {k: v / steps for k, v in device.items()}
