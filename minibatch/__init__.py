"""minibatch: LLM serving techniques on real Hugging Face models, small enough to read.

One engine (``Engine.step() = schedule -> execute -> clock -> update -> record``) and
switchable schedulers: static batching, Orca iteration-level batching, paged KV (vLLM), chunked
prefill (Sarathi-Serve), speculative decoding.
"""

__version__ = "0.2.0"

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # Our Triton kernels run on CPU under Triton's interpreter, which must be switched on before
    # anything (transformers included) first imports triton: see minibatch/kernels/__init__.py.
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from minibatch.engine import Engine, StepRecord, TokenEvent
from minibatch.records import StepEntry
from minibatch.policies import POLICIES, PolicySpec, get_policy, make_engine, register_policy
from minibatch.plugins import load_policy_module
from minibatch.request import Request, RequestStatus, SamplingParams
from minibatch.runner import ModelRunner
from minibatch.sim.executor import SimExecutor
from minibatch.scheduler import OrcaScheduler, PagedScheduler, StaticScheduler
from minibatch.clock import CostModel, SimClock, StepShape, WallClock, make_clock
from minibatch.spec import AdaptiveK, DraftModelProposer, FixedK, NgramProposer, SpeculativeRunner

__all__ = [
    "Engine", "StepEntry", "StepRecord", "TokenEvent",
    "POLICIES", "PolicySpec", "get_policy", "make_engine", "register_policy", "load_policy_module",
    "Request", "RequestStatus", "SamplingParams", "ModelRunner", "SimExecutor",
    "OrcaScheduler", "PagedScheduler", "StaticScheduler",
    "CostModel", "SimClock", "StepShape", "WallClock", "make_clock",
    "AdaptiveK", "DraftModelProposer", "FixedK", "NgramProposer", "SpeculativeRunner",
]
