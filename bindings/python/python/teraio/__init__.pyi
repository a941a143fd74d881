"""Type stubs of the teraio package (docs/PYTHON.md)."""

import ctypes
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ._errors import (
    ChecksumMismatchError as ChecksumMismatchError,
    ClosedError as ClosedError,
    CorruptionError as CorruptionError,
    DeviceError as DeviceError,
    DivergedError as DivergedError,
    InternalError as InternalError,
    InvalidArgumentError as InvalidArgumentError,
    InvalidHandleError as InvalidHandleError,
    InvalidStateError as InvalidStateError,
    IoError as IoError,
    NoSpaceError as NoSpaceError,
    OverwriteRefusedError as OverwriteRefusedError,
    PlanError as PlanError,
    SimulationError as SimulationError,
    TeraioError as TeraioError,
    TraceError as TraceError,
    UnknownTensorError as UnknownTensorError,
    UnsupportedError as UnsupportedError,
)

PathLike = Union[str, os.PathLike[str]]
Hardware = Union[str, Dict[str, Any]]

__version__: str
POLICIES: Tuple[str, ...]
MODEL_PRESETS: Tuple[str, ...]
KEY_CALLER_FIRST: int

def version() -> str: ...

class DeviceMemory:
    def __init__(self, ptr: int, nbytes: int, owner: Any = ...) -> None: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def owner(self) -> Any: ...

class HostBuffer:
    def __new__(cls, nbytes: int) -> HostBuffer: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def busy(self) -> bool: ...
    @property
    def released(self) -> bool: ...
    @property
    def __array_interface__(self) -> Dict[str, Any]: ...
    def view(self) -> ctypes.Array[ctypes.c_ubyte]: ...
    def __buffer__(self, flags: int) -> memoryview: ...
    def numpy(self, dtype: Any = ..., shape: Optional[Sequence[int]] = ...) -> Any: ...
    def release(self) -> None: ...
    def __len__(self) -> int: ...

class TensorInfo:
    id: int
    name: Optional[str]
    size_bytes: int
    location: str
    host_copy: bool
    pending_ops: int
    checksummed_chunks: int
    def __init__(
        self,
        id: int,
        name: Optional[str],
        size_bytes: int,
        location: str,
        host_copy: bool,
        pending_ops: int,
        checksummed_chunks: int,
    ) -> None: ...

class PendingOp:
    @property
    def kind(self) -> str: ...
    @property
    def tensor_id(self) -> int: ...
    def done(self) -> bool: ...
    def wait(self, timeout: Optional[float] = ...) -> Any: ...

class TeraioWarning(UserWarning): ...

class Notice:
    level: str
    message: str
    def __init__(self, level: str, message: str) -> None: ...

def notices() -> List[Notice]: ...

class Engine:
    def __init__(self, path: Optional[PathLike] = ..., /, **options: Any) -> None: ...
    @classmethod
    def from_toml(cls, text: str, **options: Any) -> Engine: ...
    @classmethod
    def from_json(cls, text: str, **options: Any) -> Engine: ...
    def offload(
        self,
        tensor_id: int,
        data: Any,
        *,
        name: Optional[str] = ...,
        destination: str = ...,
        priority: str = ...,
    ) -> PendingOp: ...
    def prefetch(self, tensor_id: int, out: Any, *, priority: str = ...) -> PendingOp: ...
    def offload_device(
        self,
        tensor_id: int,
        mem: Any,
        *,
        stream: Any = ...,
        name: Optional[str] = ...,
        destination: str = ...,
        priority: str = ...,
    ) -> PendingOp: ...
    def prefetch_device(self, tensor_id: int, mem: Any, *, stream: Any = ..., priority: str = ...) -> PendingOp: ...
    def free(self, tensor_id: int) -> PendingOp: ...
    def alloc(self, nbytes: int) -> HostBuffer: ...
    def empty(self, shape: Union[int, Sequence[int]], dtype: Any = ...) -> Any: ...
    def measure_hardware(self, cache: bool = ..., *, fresh: bool = ..., probe_bytes: Optional[int] = ...) -> Dict[str, Any]: ...
    def executor(
        self,
        trace: Union[Trace, Dict[str, Any], str],
        plan: Union[Plan, Dict[str, Any], str],
        *,
        gpu_budget_bytes: int,
        allocate_created: bool = ...,
        allocator: Any = ...,
        stream: Any = ...,
        sizes_at_most: bool = ...,
    ) -> Executor: ...
    def tensors(self) -> List[TensorInfo]: ...
    def info(self, tensor_id: int) -> Optional[TensorInfo]: ...
    def lookup(self, name: str) -> Optional[int]: ...
    def stats(self) -> Dict[str, Any]: ...
    def drain(self) -> None: ...
    def checkpoint(self) -> None: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def persistent(self) -> bool: ...
    @property
    def config(self) -> Dict[str, Any]: ...
    def describe(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Engine: ...
    def __exit__(self, *exc: Any) -> None: ...

class Executor:
    trace: Trace
    plan: Plan
    def __init__(
        self,
        engine: Engine,
        trace: Union[Trace, Dict[str, Any], str],
        plan: Union[Plan, Dict[str, Any], str, None] = ...,
        *,
        gpu_budget_bytes: int,
        allocate_created: bool = ...,
        allocator: Any = ...,
        stream: Any = ...,
        sizes_at_most: bool = ...,
    ) -> None: ...
    def attach(self, tensor_id: int, mem: Any) -> None: ...
    def start(self) -> None: ...
    def boundary(self, k: int) -> None: ...
    def boundary_named(self, k: int, name: str) -> None: ...
    def leave_plan(self, k: int, detail: str) -> None: ...
    def kernel_ready(self, k: int) -> bool: ...
    def before_kernel(self, k: int) -> float: ...
    def after_kernel(self, k: int) -> None: ...
    def leave(self, k: int, created: List[Tuple[int, int, int, Any]], device: bool) -> int: ...
    def quiet_until(self, k: int) -> int: ...
    def movable(self) -> List[bool]: ...
    def nothing_away(self) -> bool: ...
    def make_room(self, k: int, nbytes: int) -> int: ...
    def free(self, tensor_id: int) -> None: ...
    def poll(self) -> bool: ...
    def events(self) -> List[Tuple[str, int]]: ...
    def end_iteration(self, timeline: bool = ...) -> Dict[str, Any]: ...
    def gather_globals(self, limit_bytes: Optional[int] = ...) -> Dict[str, Any]: ...
    def modified(self, tensor_id: int) -> None: ...
    def finish(self) -> None: ...
    def is_resident(self, tensor_id: int) -> bool: ...
    def resident(self, tensor_id: int) -> Any: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def next_kernel(self) -> int: ...
    @property
    def diverged(self) -> Optional[Tuple[int, str]]: ...

class Trace:
    @classmethod
    def from_json(cls, text: str) -> Trace: ...
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> Trace: ...
    @property
    def name(self) -> str: ...
    @property
    def kernel_count(self) -> int: ...
    @property
    def tensor_count(self) -> int: ...
    @property
    def iteration_time_us(self) -> float: ...
    @property
    def peak_resident_bytes(self) -> int: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> Dict[str, Any]: ...
    def save(self, path: PathLike) -> None: ...

class Plan:
    @classmethod
    def from_json(cls, trace: Trace, text: str) -> Plan: ...
    @property
    def policy(self) -> str: ...
    def to_json(self) -> str: ...
    def to_dict(self) -> Dict[str, Any]: ...
    @property
    def stats(self) -> Dict[str, Any]: ...
    @property
    def instructions(self) -> List[Dict[str, Any]]: ...
    @property
    def initially_offloaded(self) -> List[Dict[str, Any]]: ...

class SimReport:
    policy: str
    trace: str
    outcome: Dict[str, Any]
    iteration_time_us: float
    ideal_time_us: float
    percent_of_ideal: float
    stall_us: float
    host_step_us: float
    peak_gpu_bytes: int
    gpu_capacity_bytes: int
    peak_host_bytes: int
    host_cap_exceeded: bool
    bytes_moved: Dict[str, int]
    migrations: int
    clean_drops: int
    timeline: Optional[Dict[str, Any]]
    @property
    def completed(self) -> bool: ...

class PolicyResult:
    policy: str
    plan_time_s: float
    plan_stats: Dict[str, Any]
    report: SimReport

def load_trace(path_or_spec: PathLike) -> Trace: ...
def generate_trace(model: str = ..., **options: Any) -> Trace: ...
def hardware(preset: Hardware = ..., **overrides: Any) -> Dict[str, Any]: ...
def plan(
    trace: Trace, policy: str = ..., hardware: Hardware = ..., *, checked: bool = ..., **overrides: Any
) -> Plan: ...
class Selection:
    plan: Plan
    info: Dict[str, Any]
    @property
    def choice(self) -> str: ...
    @property
    def why(self) -> str: ...
    @property
    def budgets(self) -> Dict[str, Any]: ...

def select(
    trace: Trace,
    policy: str = ...,
    hardware: Hardware = ...,
    *,
    gpu_budget_bytes: Optional[int] = ...,
    allowance: Optional[Dict[str, Any]] = ...,
    reserved_bytes: int = ...,
    plan_margin: float = ...,
    traffic_margin: float = ...,
    paging_fallback: Optional[bool] = ...,
    **overrides: Any,
) -> Selection: ...
def choose_checkpoint(
    trace: Trace,
    policy: str = ...,
    hardware: Hardware = ...,
    *,
    gpu_budget_bytes: Optional[int] = ...,
    allowance: Optional[Dict[str, Any]] = ...,
    reserved_bytes: int = ...,
    plan_margin: float = ...,
    paging_fallback: Optional[bool] = ...,
    **overrides: Any,
) -> Dict[str, Any]: ...
def select_budgets(
    gpu_budget_bytes: int,
    *,
    allowance: Optional[Dict[str, Any]] = ...,
    reserved_bytes: int = ...,
    plan_margin: float = ...,
    largest_tensor_bytes: int = ...,
    trace: Optional[Trace] = ...,
) -> Any: ...
def simulate(
    trace: Trace,
    plan: Plan,
    hardware: Hardware = ...,
    iterations: int = ...,
    timeline: bool = ...,
    **overrides: Any,
) -> SimReport: ...
def compare_policies(
    trace: Trace,
    policies: Optional[Sequence[str]] = ...,
    hardware: Hardware = ...,
    **overrides: Any,
) -> List[PolicyResult]: ...
def place_optimizer(
    trace: Trace,
    policy: str = ...,
    hardware: Hardware = ...,
    *,
    candidates: int = ...,
    in_backward: bool = ...,
    **overrides: Any,
) -> Dict[str, Any]: ...
def adamw_step(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step: int,
    lr: float,
    weight_decay: float,
    beta1: float = ...,
    beta2: float = ...,
    eps: float = ...,
    amsgrad: bool = ...,
    max_exp_avg_sq: Any = ...,
    maximize: bool = ...,
    decoupled_weight_decay: bool = ...,
    threads: Optional[int] = ...,
) -> None: ...
def sgd_step(
    param: Any,
    grad: Any,
    momentum_buffer: Any = ...,
    *,
    lr: float,
    momentum: float = ...,
    dampening: float = ...,
    weight_decay: float = ...,
    nesterov: bool = ...,
    maximize: bool = ...,
    fresh_buffer: bool = ...,
    threads: Optional[int] = ...,
) -> None: ...
def optimizer_info() -> Dict[str, Any]: ...
