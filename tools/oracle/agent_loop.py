"""verl's own agent loop on CPU, stock and on handed-off media (``data.media_handoff``), inside a verl 0.7 or 0.9
oracle environment (``verl_runner.py agent_loop SPEC``).

Both sides take the same prompts from this pipeline's ``VerlDataLoader`` (its rows, proven equal to verl's own
``RLHFDataset`` rows by the parity tests): the stock side as the rows are, through verl's ``AgentLoopWorker`` with
its ``RLHFDataset``; the hand-off side with ``media_handoff`` on, through ``IngestAgentLoopWorker`` in a Ray actor of
its own (the media fetched from the object store in another process) with ``IngestDataset``. Each prompt runs
``rollout.n`` times, as verl's trainer repeats a batch; a stand-in LLM server returns fixed tokens, so a prompt's
samples are alike and the two sides comparable sample by sample. What each side hands the trainer
(``generate_sequences``' tensors and ``multi_modal_inputs``) and what the server receives (prompt ids, images) is
pickled, with the hand-off worker's count of qwen-vl-utils and processor calls.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from typing import Any

import numpy as np

RESPONSE_TOKENS = [9707, 11, 1879, 0, 151645]  # "Hello, world!<|im_end|>" in Qwen2's vocabulary


class FixedTokenServer:
    """verl's LLM server client, standing in: every request gets ``RESPONSE_TOKENS``, but where ``tool_call`` is given
    (a tool call's tokens) the first request of a session whose prompt has an even number of ids gets it (so about
    half the prompts call the tool, the same ones on every side); requests are recorded."""

    def __init__(self, tool_call: list[int] | None = None, record: bool = True):
        self.requests: list[dict] = []
        self.calls = 0
        self.tool_call, self.record = tool_call, record  # record: keep each request (a bench counts them only)
        self.sessions: set[str] = set()  # request ids seen: a session keeps its id across turns

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        if self.record:
            images = [np.asarray(image) for image in image_data or []]
            videos = [np.asarray(video[0] if isinstance(video, tuple) else video) for video in video_data or []]
            self.requests.append({"prompt_ids": list(prompt_ids), "images": images, "videos": videos})
        first = request_id not in self.sessions
        self.sessions.add(request_id)
        calls_tool = first and self.tool_call and len(prompt_ids) % 2 == 0
        tokens = self.tool_call if calls_tool else RESPONSE_TOKENS
        return TokenOutput(token_ids=list(tokens), num_preempted=0)


class CallCounter:
    """Counts qwen-vl-utils' ``process_vision_info`` and the processor's calls in this process."""

    def __init__(self, processor: Any):
        import qwen_vl_utils

        self.counts = {"process_vision_info": 0, "processor": 0}
        fetch, processor_class = qwen_vl_utils.process_vision_info, type(processor)
        call = processor_class.__call__

        def counted_fetch(*args, **kwargs):
            self.counts["process_vision_info"] += 1
            return fetch(*args, **kwargs)

        def counted_call(processor_self, *args, **kwargs):
            self.counts["processor"] += 1
            return call(processor_self, *args, **kwargs)

        qwen_vl_utils.process_vision_info = counted_fetch
        processor_class.__call__ = counted_call


def tool_config(class_name: str, name: str, description: str) -> str:
    """A verl tool config file's text: one tool, ``class_name``, whose function ``name`` takes an angle's label."""
    return f"""tools:
  - class_name: {class_name}
    config: {{type: native}}
    tool_schema:
      type: function
      function:
        name: {name}
        description: {description}
        parameters:
          type: object
          properties: {{label: {{type: string, description: "The angle's label, such as ABC."}}}}
          required: [label]
"""


# the tool loop's one tool: verl's plain ``BaseTool`` with a schema (it is never called: the server's fixed response
# holds no tool call), so the prompt is rendered with a tool schema as a tool-using run's is
TOOL_CONFIG = tool_config(
    "verl.tools.base_tool.BaseTool", "measure_angle", "Measure an angle of the figure in degrees."
)


def trainer_config(
    model: str, n: int, prompt_length: int, handoff: bool, tool_config: str | None = None, response_length: int = 64
):
    """verl's own ``ppo_trainer`` config (its installed yaml) with the rollout settings this comparison needs (and
    ``tool_config``, a tool config file for the tool loop)."""
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.name=vllm",
    ]
    if tool_config is not None:
        overrides.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}")
    if handoff:
        overrides += ["+data.custom_cls.path=pkg://ingest.verl.dataset", "+data.custom_cls.name=IngestDataset"]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def repeated(batch: dict, n: int, agent: str | None = None):
    """A loader batch as verl's trainer hands it to the rollout: a ``DataProto``, each row ``n`` times in a row (each
    row's ``agent_name`` ``agent``, where given, as a dataset's ``agent_name`` column sets it)."""
    from verl.protocol import DataProto

    batch = dict(batch)
    if agent is not None:
        batch["agent_name"] = np.array([agent] * len(batch["raw_prompt"]), dtype=object)
    proto = DataProto.from_single_dict(batch, meta_info={"global_steps": 1, "validate": False})
    return proto.repeat(repeat_times=n, interleave=True)


def plain(proto) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in proto.batch.items()},
        "multi_modal_inputs": [dict(x) for x in proto.non_tensor_batch["multi_modal_inputs"]],
    }


def takes_llm_client() -> bool:
    """verl 0.9's worker takes its LLM client as an argument; 0.7.1's makes a server manager unless it has one."""
    import inspect

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    return "llm_client" in inspect.signature(AgentLoopWorker.__init__).parameters


def new_worker(cls: type, config, server: FixedTokenServer):
    """A worker of ``cls`` whose LLM server is ``server``, on either release's constructor."""
    if takes_llm_client():
        return cls(config, server)
    worker = object.__new__(cls)
    worker.server_manager = server
    cls.__init__(worker, config, [], None)
    return worker


def _handoff_worker_class():
    from ingest.verl import rollout_media
    from ingest.verl.agent_loop import IngestAgentLoopWorker

    class HandoffWorker(IngestAgentLoopWorker):
        """``IngestAgentLoopWorker`` that reports its server's requests and its media call counts."""

        def __init__(self, config, server: FixedTokenServer):
            self.server = server
            if takes_llm_client():
                super().__init__(config, server)
            else:
                self.server_manager = server
                super().__init__(config, [], None)
            self.counter = CallCounter(self.processor)

        async def run(self, batch) -> tuple[dict, list, dict]:
            started = time.process_time()
            out = await self.generate_sequences(batch)
            cpu = time.process_time() - started
            # which maker made the payloads this worker fetched (the kernels or verl's functions)
            made_by = [payload["made_by"] for payload in rollout_media._CACHE.payloads.values()]
            made = {maker: made_by.count(maker) for maker in ("kernels", "verl")}
            return plain(out), self.server.requests, {**self.counter.counts, "cpu_s": cpu, "made_by": made}

    return HandoffWorker


class WorkerHost:
    """A process hosting the comparison's workers of one side one after another (each case's, each path's), so that
    verl, transformers and torch are imported once for all of them, not once per worker actor. Stock and hand-off
    workers never share one: a hand-off worker puts our agent loops in the process's registry. An async actor: verl's
    v1 worker runs a prompt's sessions as tasks in its event loop."""

    def __init__(self):
        self.worker = None

    async def start(self, cls: type, *args) -> None:
        import gc

        from ingest.verl import rollout_media

        self.worker = None  # the last one goes first, with what it recorded
        rollout_media._CACHE.payloads.clear()  # the payloads this worker fetches alone (its "made_by" counts)
        gc.collect()
        self.worker = cls(*args)

    def rss_mib(self) -> float:
        import psutil

        return psutil.Process().memory_info().rss / 2**20

    async def call(self, method: str, *args) -> Any:
        import inspect

        result = getattr(self.worker, method)(*args)
        return await result if inspect.isawaitable(result) else result


class HostedWorker:
    """The worker a ``WorkerHost`` holds, called as an actor is (``worker.method.remote(*args)``)."""

    def __init__(self, host: Any):
        self.host = host

    def __getattr__(self, name: str) -> Any:
        host = self.host

        class Method:
            @staticmethod
            def remote(*args):
                return host.call.remote(name, *args)

        return Method


_HOSTS: dict[str, Any] = {}  # side ("stock", "handoff") -> its WorkerHost in this Ray session (one at a time)
# a host past this is replaced before its next worker: what workers leave behind (the allocator keeps freed memory)
# must not add up in a suite that runs beside others on a small machine
HOST_MAX_RSS_MIB = 2000


def hosted_worker(side: str, cls: type, *args) -> HostedWorker:
    """A ``cls(*args)`` worker in the ``WorkerHost`` of ``side``: the host of the last call where it is that side's
    and holds at most ``HOST_MAX_RSS_MIB``, else a new one (the other side's ends first: one host at a time holds a
    worker process's memory, as one worker actor at a time did)."""
    import ray

    for held in list(_HOSTS):
        if held != side or ray.get(_HOSTS[held].rss_mib.remote()) > HOST_MAX_RSS_MIB:
            ray.kill(_HOSTS.pop(held))
    if side not in _HOSTS:
        _HOSTS[side] = ray.remote(WorkerHost).options(num_cpus=0).remote()
    ray.get(_HOSTS[side].start.remote(cls, *args))
    return HostedWorker(_HOSTS[side])


def _shutdown_ray() -> None:
    """``ray.shutdown()`` once the loaders a check left mid-read are collected: such a read's iterator sits in a
    reference cycle, and its Ray Data threads (the prefetcher) would outlive the shutdown; Ray 2.55 (verl 0.7.1's own
    environment) ends the process with an error when one of them calls Ray after it."""
    import gc

    import ray

    gc.collect()
    _HOSTS.clear()
    ray.shutdown()


def compare_cases(spec: dict) -> dict:
    """``compare_on_loader_rows`` for each of ``spec["cases"]`` (files, model, data and the rest of a spec), in one
    process and one Ray session; with a TransferQueue beside it where a case asks for verl 0.9's v1 worker too, or
    ``spec["v1_steps"]`` for ``agent_loop_tq.v1_steps``."""
    import ray

    # the hand-off worker's actor imports this module: the repository root on its path, as on this process's
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    v1 = any(case.get("v1") for case in spec["cases"]) or "v1_steps" in spec
    if v1:
        from tools.oracle.agent_loop_tq import start_transfer_queue  # verl 0.9's v1 worker: TransferQueue

        start_transfer_queue()
    try:
        result = {"cases": [compare_on_loader_rows({**spec, **case}) for case in spec["cases"]]}
        if "v1_steps" in spec:  # verl 0.9's v1 async trainer's steps, a fault and a resume
            from tools.oracle.agent_loop_tq import v1_steps

            result["v1_steps"] = v1_steps(spec["v1_steps"])
        return result
    finally:
        if v1:
            import transfer_queue

            transfer_queue.close()
        _shutdown_ray()


def compare_on_loader_rows(spec: dict) -> dict:
    """Both sides on the first ``spec["batches"]`` batches of the files' rows (Ray started): through the legacy
    worker unless ``spec["legacy"]`` is false, and under ``"v1"`` through verl 0.9's v1 worker where ``spec["v1"]``
    (the same batches: each side's loader reads once)."""
    from ingest.verl import VerlDataLoader

    model, size, agent = spec["model"], spec["batch_size"], spec.get("agent")
    data = {"shuffle": False, **spec["data"]}  # row_format among them
    tool_config = None
    if agent == "tool_agent":
        tool_config = os.path.join(os.path.dirname(model), "tool_config.yaml")
        with open(tool_config, "w") as f:
            f.write(_tool_image_config(spec) if spec.get("tool_image") else TOOL_CONFIG)

    def first_batches(config: dict) -> tuple[VerlDataLoader, list[dict]]:
        """The loader (it holds the store of its handed-off media: keep it) and its first batches."""
        loader = VerlDataLoader(spec["files"], model, config, size, model, drop_last=False)
        return loader, [batch for _, batch in zip(range(spec["batches"]), loader, strict=False)]

    batches = {"stock": first_batches(data)[1]}
    loader, batches["handoff"] = first_batches({**data, "media_handoff": True})
    # the v1 stock worker first, then the hand-off workers one after another in one host (hosted_worker)
    v1 = {}
    if spec.get("v1"):
        from tools.oracle.agent_loop_tq import compare_v1

        v1 = compare_v1(spec, batches, tool_config, sides=("stock",))
    result = _compare_legacy(spec, batches, tool_config) if spec.get("legacy", True) else {}
    if spec.get("v1"):
        result["v1"] = {**v1, **compare_v1(spec, batches, tool_config, sides=("handoff",))}
    del loader  # its store goes; the next case makes its own
    return result


def _tool_image_config(spec: dict) -> str:
    """The tool config of ``image_tool.FigureCropTool``; ``spec["tool_call"]`` set to the tokens of its call, which
    the stand-in server makes on each session's first turn (the model's own tokenizer)."""
    from transformers import AutoTokenizer

    from tools.oracle.image_tool import IMAGE_TOOL_CONFIG, TOOL_CALL

    spec["tool_call"] = AutoTokenizer.from_pretrained(spec["model"]).encode(TOOL_CALL, add_special_tokens=False)
    return IMAGE_TOOL_CONFIG


def worker_settings(spec: dict, handoff: bool, tool_config: str | None) -> tuple[Any, FixedTokenServer]:
    """A worker's verl config and its stand-in server, for ``spec``'s case."""
    # a tool's image and its turn need room in the response
    response_length = 256 if spec.get("tool_image") else 64
    config = trainer_config(spec["model"], spec["n"], spec["prompt_length"], handoff, tool_config, response_length)
    return config, FixedTokenServer(spec.get("tool_call"))


def _compare_legacy(spec: dict, batches: dict[str, list[dict]], tool_config: str | None) -> dict:
    """verl's ``AgentLoopWorker`` on the stock ``batches`` (in this process) and ``IngestAgentLoopWorker`` on the
    handed-off ones (an actor of its own)."""
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    n, agent = spec["n"], spec.get("agent")
    stock_config, stock_server = worker_settings(spec, False, tool_config)
    stock = new_worker(AgentLoopWorker, stock_config, stock_server)
    expected, stock_cpu = [], 0.0
    for batch in batches["stock"]:
        started = time.process_time()
        expected.append(plain(asyncio.run(stock.generate_sequences(repeated(batch, n, agent)))))
        stock_cpu += time.process_time() - started

    worker = hosted_worker("handoff", _handoff_worker_class(), *worker_settings(spec, True, tool_config))
    handed, requests, counts = [], [], []
    for batch in batches["handoff"]:
        out, seen, count = ray.get(worker.run.remote(repeated(batch, n, agent)))
        handed.append(out)
        counts.append(count)
    requests = seen  # the worker's server keeps every request of the run
    return {
        "expected": expected,
        "handed_off": handed,
        "stock_requests": stock_server.requests,
        "handoff_requests": requests,
        "handoff_counts": counts[-1],
        "stock_cpu_s": stock_cpu,
        "last_raw_prompt": list(batch["raw_prompt"]),
    }


def _batch_keys(batch: dict) -> list[str]:
    from ingest.rollout_media import prompt_media_key

    return [found[1] for messages in batch["raw_prompt"] if (found := prompt_media_key(messages)) is not None]


def _held(loader, key: str):
    """What the loader's store holds under ``key`` (``([ref], index, file, row)``), None where it holds nothing."""
    return loader.held_media.lookup(key)


def lifetime(spec: dict) -> dict:
    """The hand-off's lifetime on one loader of ``spec["files"]``: the store's size after each batch; whether the
    first batch's media are still held once ``HELD_BATCHES`` later batches were handed out; a resumed loader's keys
    and payloads for the batch after the saved state; and what fetching a prompt raises once its store is gone."""
    import ray

    from ingest.rollout_media import HELD_BATCHES
    from ingest.verl import VerlDataLoader

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    model, size = spec["model"], spec["batch_size"]
    config = {"shuffle": False, "media_handoff": True, **spec["data"]}

    def payloads(held_loader, keys: list[str]) -> list[dict]:
        from ingest.rollout_media import decode_payload

        found = []
        for key in keys:
            (ref,), index, _, _ = _held(held_loader, key)
            payload = decode_payload(ray.get(ref)[index])
            found.append(
                {"prompt_ids": payload["prompt_ids"], "pixel_values": payload["training_inputs"]["pixel_values"]}
            )
        return found

    loader = VerlDataLoader(spec["files"], model, config, size, model, drop_last=False)
    batches = iter(loader)
    first = next(batches)
    state = loader.state_dict()
    second = next(batches)
    sizes = [loader.held_media.stats()["held"]]
    keys = [_batch_keys(first), _batch_keys(second)]
    second_payloads = payloads(loader, keys[1])  # while held: the batch a loader resumed from ``state`` makes again
    for batch in batches:
        keys.append(_batch_keys(batch))
        sizes.append(loader.held_media.stats()["held"])
    released = [_held(loader, key) is None for key in keys[0]]
    last_held = [_held(loader, key) is not None for batch in keys[-HELD_BATCHES:] for key in batch]

    resumed = VerlDataLoader(spec["files"], model, config, size, model, drop_last=False)
    resumed.load_state_dict(state)
    resumed_batches = iter(resumed)
    again = next(resumed_batches)
    resume = {
        "index": (list(second["index"]), list(again["index"])),
        "keys": (keys[1], _batch_keys(again)),
        "payloads": (payloads(resumed, _batch_keys(again)), second_payloads),
    }

    @ray.remote
    def fetch(store: str, key: str) -> str:
        from ingest.verl.rollout_media import fetch_payload

        try:
            fetch_payload(store, key)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "fetched"

    resumed_batches.close()  # its pipeline stops while Ray is up
    # a store that is gone (its loader ended): fetching from it says so (another prompt than the one fetched before:
    # a worker process keeps what it fetched)
    name, keys_again = resumed.held_media.name, _batch_keys(again)
    before = ray.get(fetch.remote(name, keys_again[0]))
    ray.kill(resumed.held_media.store)
    gone = ray.get(fetch.remote(name, keys_again[1]))
    _shutdown_ray()
    return {
        "sizes": sizes,
        "rows": sum(len(k) for k in keys),
        "released": released,
        "last_held": last_held,
        "resume": resume,
        "store_gone": {"before": before, "after": gone},
    }


# verl's AgentLoopManager splits each batch over this many agent-loop workers (agent.num_workers' default)
AGENT_LOOP_WORKERS = 8


class RolloutStandIn:
    """The rollout workers' side of the hand-off, standing in for the agent loop: a batch split as verl splits it over
    ``AGENT_LOOP_WORKERS`` workers, each part's payloads fetched, then each prompt resolved for each of its ``n``
    samples (``prompt_media`` then ``sample_media``, as ``IngestDataset`` and the loops do), in a process of its own;
    the CPU seconds it took."""

    def resolve(self, raw_prompt: list, n: int) -> dict:
        from ingest.verl.rollout_media import prefetch, prompt_media, sample_media

        started, samples = time.process_time(), 0
        part = max(1, -(-len(raw_prompt) // AGENT_LOOP_WORKERS))
        for first in range(0, len(raw_prompt), part):
            prefetch(raw_prompt[first : first + part])  # as IngestAgentLoopWorker does before its samples run
            for messages in raw_prompt[first : first + part]:
                for _ in range(n):
                    payload = prompt_media(messages)
                    images, _, _ = sample_media(payload)
                    assert images is not None
                    samples += 1
        return {"samples": samples, "cpu_s": time.process_time() - started}


def _stalled(loader, seconds: float = 1.5) -> dict:
    """The store's figures once the pipeline has had ``seconds`` with no change while the loader takes nothing:
    what it makes ahead of a trainer that stopped."""
    last = None
    while True:
        time.sleep(seconds)
        now = loader.held_media.stats()
        if now == last:
            return now
        last = now


def bound(spec: dict) -> dict:
    """One epoch over ``spec["files"]`` in batches of ``spec["batch_size"]``, each batch's prompts resolved
    ``spec["n"]`` times in a stand-in rollout worker, the loader stalling at ``spec["stall_at"]`` batches: the
    store's figures at each stall and at the end, and the rollout's CPU per sample."""
    import ray

    from ingest.verl import VerlDataLoader

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = {"shuffle": False, "media_handoff": True, **spec["data"]}
    loader = VerlDataLoader(spec["files"], spec["model"], config, spec["batch_size"], spec["model"], drop_last=False)
    rollout = ray.remote(RolloutStandIn).options(num_cpus=0).remote()
    stalls, rows, samples, cpu_s = [], 0, 0, 0.0
    for step, batch in enumerate(loader):
        if step in spec["stall_at"]:
            stalls.append({"step": step, **_stalled(loader)})
        done = ray.get(rollout.resolve.remote(list(batch["raw_prompt"]), spec["n"]))
        rows, samples, cpu_s = rows + len(batch["raw_prompt"]), samples + done["samples"], cpu_s + done["cpu_s"]
    end = loader.held_media.stats()
    _shutdown_ray()
    return {"rows": rows, "samples": samples, "rollout_cpu_s": cpu_s, "stalls": stalls, "end": end}


class CpuMeter:
    """CPU seconds spent in the functions it wraps (each thread's own time; a wrapped call inside another counts
    once)."""

    def __init__(self):
        import threading

        self.seconds, self.calls, self._depth = 0.0, 0, threading.local()

    def wrap(self, function):
        import functools

        @functools.wraps(function)
        def timed(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    self.seconds += time.thread_time() - started
                    self.calls += 1

        return timed


def _meter_media_work(meter: CpuMeter, handoff: bool) -> None:
    """Wraps what the agent loop does with a prompt's media, stock (verl's qwen-vl-utils step, its continuous-token
    builder, the worker's training inputs) and handed off (the payload's resolution and the same two seams)."""
    import verl.experimental.agent_loop.agent_loop as agent_loop
    from verl.utils.dataset.rl_dataset import RLHFDataset

    RLHFDataset._process_multi_modal_info = classmethod(meter.wrap(RLHFDataset._process_multi_modal_info.__func__))
    create = agent_loop.create_continuous_token_builder

    def metered_builder(*args, **kwargs):
        builder = create(*args, **kwargs)
        builder.build_initial_tokens = meter.wrap(builder.build_initial_tokens)
        return builder

    agent_loop.create_continuous_token_builder = metered_builder
    agent_loop.AgentLoopWorker._compute_multi_modal_inputs = meter.wrap(
        agent_loop.AgentLoopWorker._compute_multi_modal_inputs
    )
    if handoff:
        import ingest.verl.agent_loop as ours
        import ingest.verl.rollout_media as rollout_media

        rollout_media.prefetch = meter.wrap(rollout_media.prefetch)
        rollout_media.prompt_media = meter.wrap(rollout_media.prompt_media)
        rollout_media.sample_media = meter.wrap(rollout_media.sample_media)
        ours._HandedOffPromptTokens.build_initial_tokens = meter.wrap(ours._HandedOffPromptTokens.build_initial_tokens)
        ours._HandedOffInputsMixin._compute_multi_modal_inputs = meter.wrap(
            ours._HandedOffInputsMixin._compute_multi_modal_inputs
        )


class BenchWorker:
    """An agent-loop worker (verl's, or ``IngestAgentLoopWorker`` with ``handoff``) with a stand-in server, its media
    work metered: what one ``generate_sequences`` call cost this process."""

    def __init__(self, config, handoff: bool):
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

        self.meter = CpuMeter()
        _meter_media_work(self.meter, handoff)
        if handoff:
            from ingest.verl.agent_loop import IngestAgentLoopWorker as cls
        else:
            cls = AgentLoopWorker
        self.worker = new_worker(cls, config, FixedTokenServer(record=False))
        self.step_cpu_s, self.samples = 0.0, 0

    async def run(self, batch) -> int:
        started = time.process_time()
        out = await self.worker.generate_sequences(batch)
        self.step_cpu_s += time.process_time() - started
        self.samples += len(out)
        return len(out)

    def stats(self) -> dict:
        return {"samples": self.samples, "step_cpu_s": self.step_cpu_s, "media_cpu_s": self.meter.seconds}


def _stock_batches(files: list[str], spec: dict, config):
    """verl 0.9's own loader as its trainer makes it: ``RLHFDataset`` and a ``StatefulDataLoader`` with verl's
    ``collate_fn`` and its config's workers."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.utils import hf_processor, hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    data = config.data
    dataset = RLHFDataset(files, hf_tokenizer(spec["model"]), data, hf_processor(spec["model"]))
    workers = data.get("dataloader_num_workers", 8)
    return StatefulDataLoader(dataset, batch_size=spec["batch_size"], num_workers=workers, collate_fn=collate_fn)


def _side_batches(side: str, spec: dict, config):
    """Each file set's batches in turn (a data set of one schema each): verl's loader (stock) or ours."""
    for files in spec["file_sets"]:
        if side == "stock":
            yield from _stock_batches(files, spec, config)
            continue
        from ingest.verl import VerlDataLoader

        data = {"row_format": "verl-0.9", "shuffle": False, "max_prompt_length": spec["prompt_length"]}
        data["media_handoff"] = side == "hand-off"
        yield from VerlDataLoader(files, spec["model"], data, spec["batch_size"], spec["model"], drop_last=False)


def _legacy_steps(batches, workers: list, n: int) -> int:
    """verl's legacy manager's way: each batch ``n`` times over, split over the workers, waited for."""
    import ray

    prompts = 0
    for batch in batches:
        if workers:
            chunks = repeated(batch, n).chunk(len(workers))
            ray.get([worker.run.remote(chunk) for worker, chunk in zip(workers, chunks, strict=True)])
        prompts += len(batch["raw_prompt"])
    return prompts


def bench_side(spec: dict) -> dict:
    """One side of ``python -m ingest bench handoff`` in a new process (the clock starts before Ray does): every
    batch of ``spec["file_sets"]`` (one after another) through ``spec["workers"]`` agent-loop workers, each prompt
    ``rollout.n`` times. Stock: verl's own loader and worker; hand-off: ``VerlDataLoader`` with ``media_handoff`` and
    ``IngestAgentLoopWorker``; rows: ``VerlDataLoader`` without it and no agent loop (what the pipeline spends on
    the rows alone, so that the hand-off's share of the pipeline's CPU is known whatever actors its stage runs in).
    ``spec["path"]``: ``legacy`` (verl's manager repeats and splits each batch) or ``v1`` (verl's v1 trainer code
    registers and submits each batch in TransferQueue; ``AgentLoopWorkerTQ`` runs a prompt's sessions)."""
    import resource

    import ray

    side = {"bench_stock": "stock", "bench_handoff": "hand-off", "bench_rows": "rows"}[spec["check"]]
    handoff, v1 = side == "hand-off", spec.get("path") == "v1"
    started, cpu_started = time.perf_counter(), time.process_time()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    config = trainer_config(spec["model"], spec["n"], spec["prompt_length"], handoff)
    config.data.max_prompt_length = spec["prompt_length"]
    workers = []
    if side != "rows":
        if v1:
            from tools.oracle.agent_loop_tq import bench_worker_class, start_transfer_queue

            start_transfer_queue()
            remote = ray.remote(bench_worker_class(handoff)).options(num_cpus=0)
        else:
            remote = ray.remote(BenchWorker).options(num_cpus=0)
        workers = [remote.remote(config, handoff) for _ in range(spec["workers"])]
    batches = _side_batches(side, spec, config)
    if v1 and workers:
        from tools.oracle.agent_loop_tq import v1_bench_steps

        prompts = v1_bench_steps(batches, workers, spec["batch_size"])
    else:
        prompts = _legacy_steps(batches, workers, spec["n"])
    wall_s = time.perf_counter() - started
    stats = ray.get([worker.stats.remote() for worker in workers])
    children = os.times()
    result = {
        "side": side,
        "path": spec.get("path", "legacy"),
        "prompts": prompts,
        "samples": sum(s["samples"] for s in stats),
        "wall_s": round(wall_s, 2),
        "rollout_media_cpu_s": round(sum(s["media_cpu_s"] for s in stats), 2),
        "step_cpu_s": round(sum(s["step_cpu_s"] for s in stats), 2),
        "controller_cpu_s": round(time.process_time() - cpu_started, 2),
        "controller_children_cpu_s": round(children.children_user + children.children_system, 2),
        "controller_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if v1 and workers:
        import transfer_queue

        transfer_queue.close()
    _shutdown_ray()
    return result


def _difference(ours: Any, theirs: Any, path: str = "") -> str | None:
    """Where two payloads (``decode_payload``'s form) differ, None where every key, dtype, shape and value is equal."""
    import numpy as np
    import torch
    from PIL import Image

    if isinstance(theirs, torch.Tensor):
        same = isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and ours.shape == theirs.shape
        return None if same and torch.equal(ours, theirs) else f"{path}: {ours!r:.80} != {theirs!r:.80}"
    if isinstance(theirs, Image.Image):
        same = isinstance(ours, Image.Image) and (ours.mode, ours.size) == (theirs.mode, theirs.size)
        return None if same and np.array_equal(np.asarray(ours), np.asarray(theirs)) else f"{path}: image differs"
    if isinstance(theirs, dict):
        if not isinstance(ours, dict) or list(ours) != list(theirs):
            return f"{path}: keys {list(ours) if isinstance(ours, dict) else ours!r:.80} != {list(theirs)}"
        found = (_difference(ours[k], theirs[k], f"{path}.{k}") for k in theirs)
        return next((d for d in found if d), None)
    if isinstance(theirs, (list, tuple)):
        if type(ours) is not type(theirs) or len(ours) != len(theirs):
            return f"{path}: {ours!r:.80} != {theirs!r:.80}"
        found = (_difference(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(ours, theirs, strict=True)))
        return next((d for d in found if d), None)
    return None if ours == theirs else f"{path}: {ours!r:.80} != {theirs!r:.80}"


def payloads(spec: dict) -> dict:
    """The kernels' payloads (``KernelMediaMaker``) against verl's functions' (``PromptMediaMaker``) for the prompts
    our loader hands verl (``spec["files"]``, verl-0.9 rows: PIL images in the items), for each of
    ``spec["models"]``: per model, the prompts both made equal, those the kernels left to verl, those verl refused
    (the kernels must refuse them too) and any difference."""
    import ray

    from ingest.config import DataConfig
    from ingest.rollout_media import PromptMediaMaker, decode_payload, encode_payload
    from ingest.rollout_media_kernels import KernelMediaMaker
    from ingest.stages.rollout_media import verl_data_section
    from ingest.verl import VerlDataLoader

    config = {"shuffle": False, "row_format": "verl-0.9", "max_prompt_length": 8192}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    loader = VerlDataLoader(spec["files"], spec["models"][0], config, 16, spec["models"][0], drop_last=False)
    prompts = [list(messages) for batch in loader for messages in batch["raw_prompt"]]
    _shutdown_ray()
    data = verl_data_section(DataConfig(**config))
    results = {}
    for model in spec["models"]:
        kernels, verl = KernelMediaMaker.for_model(model, data), PromptMediaMaker(model, data)
        counts = {"equal": 0, "left_to_verl": 0, "refused": 0, "differences": []}
        for i, messages in enumerate(prompts):
            try:
                theirs = decode_payload(encode_payload(verl.make(messages)))
            except Exception:
                theirs = None
            try:
                made = kernels.make(messages)
            except Exception:
                made = "refused"
            if made is None:
                counts["left_to_verl"] += 1
            elif theirs is None and made == "refused":
                counts["refused"] += 1
            elif theirs is None:
                counts["differences"].append(f"prompt {i}: verl refused it, the kernels made it")
            elif made == "refused":
                counts["differences"].append(f"prompt {i}: the kernels refused it, verl made it")
            else:
                ours = decode_payload(made)
                assert ours.pop("made_by") == "kernels"
                difference = _difference(ours, theirs)
                counts["equal"] += difference is None
                counts["differences"] += [f"prompt {i}{difference}"] if difference else []
        results[model] = counts
    return {"prompts": len(prompts), "models": results}


CHECKS = {
    "payloads": payloads,
    "lifetime": lifetime,
    "bound": bound,
    **dict.fromkeys(("bench_stock", "bench_handoff", "bench_rows"), bench_side),
}


def several(spec: dict) -> dict:
    """Each of ``spec["checks"]`` (a name -> a spec with its ``check``), one after another in this process: the
    result of each by name."""
    results = {}
    for name, check in spec["checks"].items():
        started = time.perf_counter()
        results[name] = {**CHECKS[check["check"]](check), "seconds": time.perf_counter() - started}
    return results


CHECKS["compare"] = compare_cases
CHECKS["several"] = several


def main(spec: dict) -> None:
    result = CHECKS.get(spec.get("check"), compare_cases)(spec)
    with open(spec["out"], "wb") as f:
        pickle.dump(result, f)
