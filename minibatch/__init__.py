"""minibatch: LLM serving techniques on real Hugging Face models, small enough to read.

One engine (``Engine.step() = schedule -> execute -> clock -> update -> record``) and
switchable schedulers: static batching, Orca iteration-level batching, ...
"""

__version__ = "0.1.0"

from minibatch.engine import Engine, StepEntry, StepRecord, TokenEvent
from minibatch.policies import ENGINE_POLICIES, make_engine
from minibatch.request import Request, RequestStatus, SamplingParams
from minibatch.runner import ModelRunner, SimExecutor
from minibatch.scheduler import OrcaScheduler, StaticScheduler
from minibatch.sim.clock import CostModel, SimClock, WallClock, make_clock

__all__ = [
    "Engine", "StepEntry", "StepRecord", "TokenEvent", "ENGINE_POLICIES", "make_engine",
    "Request", "RequestStatus", "SamplingParams", "ModelRunner", "SimExecutor",
    "OrcaScheduler", "StaticScheduler", "CostModel", "SimClock", "WallClock", "make_clock",
]
