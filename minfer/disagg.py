import copy, datetime, os, pickle, queue, socket, threading, time, traceback, weakref
from collections import deque
from dataclasses import replace
from types import SimpleNamespace
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from .engine import build_model, build_engine, parse_cores
from .paged import BlockTable, OutOfBlocks

#%%
ROLES = ("prefill", "decode")  # their ranks in the workers' process group: 0 and 1

class WorkerDied(RuntimeError):
    "A worker process of a `DisaggEngine` exited or failed; its requests in flight ended with finish_reason='error'."

def post(q, *msg):
    "Put a message on a multiprocessing queue, pickled now (the queue's feeder thread would pickle it later)."
    q.put(pickle.dumps(msg))

def take_messages(q, wait=0.0):
    "Every message waiting on `q`, after waiting up to `wait` seconds for the first."
    msgs = []
    try:
        msgs.append(pickle.loads(q.get(timeout=wait) if wait > 0 else q.get_nowait()))
        while True: msgs.append(pickle.loads(q.get_nowait()))
    except queue.Empty: pass
    return msgs

def portable(seq):
    "A copy of `seq` that can cross to another process: its tokens and state, not its blocks, prefix-cache node or forks."
    c = copy.copy(seq)
    c.block_table, c.radix_node, c.forks, c.output_ids = None, None, [], list(seq.output_ids)
    return c

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def transfer_tag(pid): return pid % 2**31  # one tag per transfer: a late or missing message cannot be taken for another

#%%
class Worker:
    """One process: a model, an engine over its own paged pool, a rank in the workers' process group.
    The loop: read the inbox (block briefly when idle), do this role's work, repeat; leave when told to stop or when
    the front process is gone."""
    def __init__(self, role, config, port, inbox, outbox, peer, options):
        self.role, self.inbox, self.outbox, self.peer = role, inbox, outbox, peer
        self.timeout = datetime.timedelta(seconds=options["timeout"])
        self.parent = os.getppid()
        cores = parse_cores(config.prefill_cores if role == "prefill" else config.decode_cores)
        if config.device == "cpu":
            if hasattr(os, "sched_setaffinity"): os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        elif torch.cuda.device_count() > 1: torch.cuda.set_device(ROLES.index(role))  # a GPU each
        # the prefix cache lives on the prefill side: the decode worker gets prompts' KV sent, it never computes them
        own = replace(config, pd_split=False, prefill_cores="auto", decode_cores="auto",
                      prefix_cache=config.prefix_cache and role == "prefill", **options.get(role + "_overrides", {}))
        self.config, self.model = own, build_model(own)
        self.engine = build_engine(own, self.model)
        self.cache = self.engine.cache
        # NCCL moves GPU memory directly but wants a GPU per rank; otherwise gloo, through host memory
        nccl = config.device == "cuda" and torch.cuda.device_count() > 1
        self.wire = self.cache.k.device if nccl else torch.device("cpu")
        dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=ROLES.index(role), world_size=2, timeout=self.timeout)
        self.spans, self.transfers = [], []  # (start, end, tokens, sequences) per step; one entry per KV transfer
        with torch.inference_mode():  # first-call setup should not count as the first request's time
            dev = self.model.device
            self.model(torch.tensor([0], device=dev), torch.tensor([0], device=dev), lambda l, q, k, v: q)
        post(outbox, "ready", role, os.getpid(), self.cache.num_blocks, self.cache.block_size)

    def run(self):
        while os.getppid() == self.parent:  # the front process died: leave rather than linger
            for msg in take_messages(self.inbox, wait=0 if self.busy() else 0.05):
                if msg[0] == "stop": return
                if msg[0] == "stats": post(self.outbox, "stats", self.role, self.stats())
                else: getattr(self, "on_" + msg[0])(*msg[1:])
            self.work()

    def step(self):
        "One engine step, timed for the timeline; tell the front process who got which token."
        t0 = time.perf_counter()
        got = self.engine.step()
        _, kinds, _ = self.engine.history[-1] if self.engine.history else (0, [], 0)
        self.spans.append((t0, time.perf_counter(), sum(n for _, n, _ in kinds), len(kinds)))
        post(self.outbox, "tokens", [token_news(s) for s in got])
        return got

    def stats(self):
        return dict(**self.engine.stats, spans=list(self.spans), transfers=list(self.transfers), pid=os.getpid())

def token_news(s):
    "What the front process needs to know about a new token of `s`."
    first = len(s.output_ids) == 1
    extra = dict(prompt_logprobs=s.prompt_logprobs, num_cached_tokens=s.metrics.num_cached_tokens,
                 first_scheduled_time=s.metrics.first_scheduled_time) if first else None
    lp = s.logprobs[-1] if s.logprobs else None
    return s.id, s.output_ids[-1], lp, s.finished, s.metrics.bytes_per_token, extra

#%%
class PrefillWorker(Worker):
    """Runs prompts to their first token, then holds their blocks until the decode worker pulls them (or drops them).
    Its prefix cache keeps every prompt's whole blocks once they have been sent."""
    def __init__(self, *args):
        super().__init__(*args)
        self.groups = {}    # parent id -> [parent, its forks] while the prompt is being computed
        self.exported = {}  # parent id -> the group's unfinished sequences, prefilled, blocks held
        self.sends, self.sent = queue.Queue(), queue.Queue()  # to and from the sending thread
        self.send_delay = 0.0
        threading.Thread(target=self.send_loop, daemon=True).start()

    def busy(self): return self.engine.has_unfinished() or bool(self.exported)

    def on_add(self, seq, forks):
        self.engine.add(seq, forks)
        self.groups[seq.id] = [seq, *forks]

    def on_abort(self, seq_id): self.engine.abort(seq_id)  # a prefilled group is dropped by the decode side instead

    def on_pull(self, pid):
        "The decode worker has room for this group: send its blocks (from a thread, so prefill goes on meanwhile)."
        blocks = self.exported[pid][0].block_table.blocks
        self.sends.put((pid, self.cache.read_blocks(blocks), len(self.exported[pid][0].prompt_ids)))

    def on_drop(self, pid): self.release(pid)

    def on_delay(self, seconds): self.send_delay = seconds  # tests: hold each transfer, to abort in the middle of one

    def work(self):
        while not self.sent.empty():
            pid, record = self.sent.get()
            self.transfers.append(record)
            self.release(pid)
        if not self.engine.has_unfinished(): return
        self.step()
        for pid, group in list(self.groups.items()):
            if not (group[0].output_ids or group[0].finished): continue  # its prompt is not done yet
            del self.groups[pid]
            live = [s for s in group if not s.finished]
            if not live: continue
            for s in live: self.engine.scheduler.running.remove(s)  # not decoded here: held for the transfer
            self.exported[pid] = live
            post(self.outbox, "prefilled", pid, [portable(s) for s in live], len(live[0].block_table.blocks))

    def release(self, pid):
        "The group's blocks go back; the first sequence's whole prompt blocks stay in the prefix cache."
        for i, s in enumerate(self.exported.pop(pid, [])): self.engine.scheduler._release(s, cache_it=i == 0)

    def send_loop(self):
        "Header first (transfer id, blocks, layers, tensors), so the receiver can allocate; then layer by layer."
        while True:
            pid, data, prompt_len = self.sends.get()
            time.sleep(self.send_delay)
            t0, names = time.perf_counter(), list(data)
            layers, n = data[names[0]].shape[:2]
            header = torch.tensor([pid, n, layers, len(names)], dtype=torch.int64, device=self.wire)
            nbytes, error = 0, None
            try:
                dist.isend(header, 1, tag=transfer_tag(pid)).wait(self.timeout)
                for layer in range(layers):
                    for name in names:
                        x = data[name][layer].to(self.wire).contiguous()
                        dist.isend(x, 1, tag=transfer_tag(pid)).wait(self.timeout)
                        nbytes += x.numel() * x.element_size()
            except RuntimeError as e: error = str(e).splitlines()[0]
            self.sent.put((pid, dict(id=pid, prompt_tokens=prompt_len, blocks=n, bytes=nbytes, start=t0,
                                     end=time.perf_counter(), error=error)))

#%%
class DecodeWorker(Worker):
    """Admits prefilled groups when its pool has room for them (until then they wait, their blocks held by the prefill
    worker), pulls their blocks, and decodes them to the end."""
    def __init__(self, *args):
        super().__init__(*args)
        self.pending = deque()  # (pid, group, blocks) handed over, waiting for room in this pool
        self.receiving = {}     # pid -> (group, block ids here) while its blocks are on the way
        self.aborted = set()    # ids the front process aborted (they may arrive later: drop them then)
        self.recvs, self.received = queue.Queue(), queue.Queue()  # to and from the receiving thread
        threading.Thread(target=self.recv_loop, daemon=True).start()

    def busy(self): return self.engine.has_unfinished() or bool(self.pending or self.receiving)

    def on_admit(self, pid, group, n_blocks): self.pending.append((pid, group, n_blocks))

    def on_abort(self, seq_id):
        self.aborted.add(seq_id)
        self.engine.abort(seq_id)

    def work(self):
        while not self.received.empty(): self.arrived(*self.received.get())
        while self.pending:
            pid, group, n = self.pending[0]
            group = [s for s in group if s.id not in self.aborted]
            if not group:  # aborted before it was pulled: the prefill worker can let its blocks go
                self.pending.popleft()
                post(self.peer, "drop", pid)
                continue
            try: ids = self.cache.allocator.allocate(n)
            except OutOfBlocks: break  # it waits, in order; nothing is lost: the prefill worker holds its blocks
            self.pending.popleft()
            self.receiving[pid] = (group, ids)
            self.recvs.put(pid)
            post(self.peer, "pull", pid)
        if self.engine.has_unfinished(): self.step()
        elif self.receiving: time.sleep(0.001)  # only waiting for the wire

    def arrived(self, pid, data, record):
        "A transfer ended: write its blocks and start decoding its sequences (or report why it failed)."
        group, ids = self.receiving.pop(pid)
        self.transfers.append(record)
        live = [s for s in group if s.id not in self.aborted]
        if record["error"] or not live:
            self.cache.allocator.free(ids)
            if live: post(self.outbox, "failed", [s.id for s in live], f"KV transfer failed: {record['error']}")
            return
        self.cache.write_blocks(ids, data)
        table = BlockTable(self.cache.allocator, ids, live[0].num_computed, share=False)
        for i, s in enumerate(live):
            s.block_table, s.status = table if i == 0 else table.fork(), "running"
            self.engine.scheduler.running.append(s)

    def recv_loop(self):
        "Receive the header, allocate buffers of the size it gives, receive layer by layer; each wait has a timeout."
        while True:
            pid = self.recvs.get()
            t0, data, nbytes, error = time.perf_counter(), None, 0, None
            try:
                header = torch.zeros(4, dtype=torch.int64, device=self.wire)
                dist.irecv(header, 0, tag=transfer_tag(pid)).wait(self.timeout)
                got, n, layers, n_names = header.tolist()
                names = list(self.cache.tensors)
                if (got, layers, n_names) != (pid, self.cache.k.shape[0], len(names)):
                    raise RuntimeError(f"header {header.tolist()} does not match transfer {pid}")
                data = {k: torch.empty((layers, n, *t.shape[2:]), dtype=t.dtype, device=self.wire)
                        for k, t in self.cache.tensors.items()}
                for layer in range(layers):
                    for name in names:
                        dist.irecv(data[name][layer], 0, tag=transfer_tag(pid)).wait(self.timeout)
                        nbytes += data[name][layer].numel() * data[name][layer].element_size()
            except RuntimeError as e: error = str(e).splitlines()[0]
            self.received.put((pid, data, dict(id=pid, blocks=n if data else 0, bytes=nbytes, start=t0,
                                               end=time.perf_counter(), error=error)))

def worker_main(role, config, port, inbox, outbox, peer, options):
    "A worker process's body: build, report ready, loop; any failure goes to the front process as one message."
    try:
        (PrefillWorker if role == "prefill" else DecodeWorker)(role, config, port, inbox, outbox, peer, options).run()
    except BaseException as e:
        post(outbox, "error", role, f"{type(e).__name__}: {e}", traceback.format_exc())
        raise SystemExit(1)

#%%
class DisaggEngine:
    """The front process's engine for `pd_split=True`: the same `add` / `step` / `has_unfinished` / `abort` as
    `LLMEngine`, over a prefill worker and a decode worker (spawned processes). It routes: a new request goes to the
    prefill worker; a prefilled one (its first token out) is handed with its block count to the decode worker, which
    pulls its KV blocks straight from the prefill worker over torch.distributed; tokens stream back here.
    Every wait has a timeout; a worker that dies ends the requests in flight with finish_reason='error' and a
    `WorkerDied` from `step()`, after which the engine is closed. `close()` (or exit) stops both workers."""
    def __init__(self, config, *, timeout=30.0, start_timeout=300.0, prefill_overrides=None, decode_overrides=None):
        self.config, self.timeout = config, timeout
        ctx = mp.get_context("spawn")
        self.inboxes, self.outbox = {r: ctx.Queue() for r in ROLES}, ctx.Queue()
        options = dict(timeout=timeout, prefill_overrides=prefill_overrides or {}, decode_overrides=decode_overrides or {})
        port, other = free_port(), dict(zip(ROLES, reversed(ROLES)))
        self.procs = {r: ctx.Process(target=worker_main, name=f"minfer-{r}", daemon=True,
                                     args=(r, config, port, self.inboxes[r], self.outbox, self.inboxes[other[r]], options))
                      for r in ROLES}
        for p in self.procs.values(): p.start()
        # stops the workers on close(), garbage collection or interpreter exit, whichever comes first
        self._finalizer = weakref.finalize(self, stop_workers, self.procs, [*self.inboxes.values(), self.outbox])
        self.seqs, self.forks = {}, {}  # unfinished sequences by id; a parent's not-yet-started forks
        self.errors, self.routed, self.worker_info, self.closed = {}, [], {}, None
        self._stats, self._last_news = {}, time.perf_counter()
        deadline = time.perf_counter() + start_timeout
        while len(self.worker_info) < len(ROLES):
            if time.perf_counter() > deadline: self._fail(f"workers not ready after {start_timeout:.0f} s")
            self._handle(take_messages(self.outbox, wait=0.1))
        self.cache = SimpleNamespace(num_blocks=min(i["num_blocks"] for i in self.worker_info.values()),
                                     block_size=config.block_size)  # what one request may hold: the smaller pool

    def __repr__(self):
        return f"DisaggEngine(prefill pid {self.procs['prefill'].pid}, decode pid {self.procs['decode'].pid})"

    def add(self, seq, forks=()):
        self._check_open()
        need = -(-seq.max_len // self.cache.block_size)
        if need > self.cache.num_blocks:
            raise ValueError(f"request needs {need} KV blocks (prompt + max_tokens = {seq.max_len} tokens), the pool "
                             f"has {self.cache.num_blocks}; shorten it or raise kv_cache_bytes")
        for s in (seq, *forks): self.seqs[s.id] = s
        self.forks[seq.id] = list(forks)
        post(self.inboxes["prefill"], "add", portable(seq), [portable(f) for f in forks])

    def has_unfinished(self): return bool(self.seqs)

    def abort(self, seq_id):
        "Abort a sequence wherever it is (its not-yet-started forks too); both workers drop it."
        if self.closed: return
        s = self.seqs.pop(seq_id, None)
        if s is None: return
        s.abort()
        later = self.forks.pop(seq_id, []) if not s.output_ids else []
        for f in [s, *later]:
            self.seqs.pop(f.id, None)
            f.abort()
            for r in ROLES: post(self.inboxes[r], "abort", f.id)

    def step(self):
        "Wait briefly for the workers' news, apply it; -> the sequences that got a token (as `LLMEngine.step`)."
        self._check_open()
        got = self._handle(take_messages(self.outbox, wait=0.05 if self.seqs else 0))
        for r, p in self.procs.items():
            if not p.is_alive(): self._fail(f"the {r} worker (pid {p.pid}) exited with code {p.exitcode}")
        if self.seqs and time.perf_counter() - self._last_news > self.timeout:
            self._fail(f"no news from the workers for {self.timeout:.0f} s")
        return got

    def _handle(self, msgs):
        got = []
        for kind, *args in msgs:
            self._last_news = time.perf_counter()
            if kind == "tokens": got += self._on_tokens(*args)
            elif kind == "prefilled": self._on_prefilled(*args)
            elif kind == "failed": self._end([self.seqs[i] for i in args[0] if i in self.seqs], args[1])
            elif kind == "ready": self.worker_info[args[0]] = dict(pid=args[1], num_blocks=args[2], block_size=args[3])
            elif kind == "stats": self._stats[args[0]] = args[1]
            elif kind == "error": self._fail(f"the {args[0]} worker failed: {args[1]}")
        return got

    def _on_tokens(self, news):
        got = []
        for sid, token, logprobs, worker_done, bytes_per_token, extra in news:
            s = self.seqs.get(sid)
            if s is None: continue  # aborted here meanwhile
            if extra:
                self.forks.pop(sid, None)
                if extra["prompt_logprobs"] is not None: s.prompt_logprobs = extra["prompt_logprobs"]
                s.metrics.num_cached_tokens = extra["num_cached_tokens"]
                s.metrics.first_scheduled_time = extra["first_scheduled_time"]
            s.append(token, logprobs)
            s.metrics.bytes_per_token = bytes_per_token
            got.append(s)
            if s.finished:
                del self.seqs[sid]
                if not worker_done:  # a stop string (only this process has the tokenizer): the workers drop it
                    for r in ROLES: post(self.inboxes[r], "abort", sid)
        return got

    def _on_prefilled(self, pid, group, n_blocks):
        "The router: a prefilled group goes to the decode worker, or back to the prefill worker to drop if all ended."
        self.routed.append((time.perf_counter(), pid, n_blocks))
        if any(s.id in self.seqs for s in group): post(self.inboxes["decode"], "admit", pid, group, n_blocks)
        else: post(self.inboxes["prefill"], "drop", pid)

    def _end(self, seqs, reason):
        for s in seqs:
            s.abort()
            s.finish_reason = "error"
            self.errors[s.id] = reason
            self.seqs.pop(s.id, None)

    def _fail(self, reason):
        "A worker is gone: end every request in flight with an error, stop the workers, raise one clear line."
        n = len(self.seqs)
        self._end(list(self.seqs.values()), reason)
        self.closed = reason
        self._finalizer()
        raise WorkerDied(f"{reason}; {n} request(s) in flight ended with finish_reason='error'; "
                         "the P/D workers are stopped: create a new engine")

    def _check_open(self):
        if self.closed: raise WorkerDied(f"this engine's workers are stopped ({self.closed}); create a new engine")

    def worker_stats(self, timeout=None):
        "Each worker's counters, step spans and transfer log: {'prefill': {...}, 'decode': {...}}."
        self._check_open()
        self._stats = {}
        for r in ROLES: post(self.inboxes[r], "stats")
        deadline = time.perf_counter() + (timeout or self.timeout)
        while len(self._stats) < len(ROLES):
            if time.perf_counter() > deadline: self._fail("workers did not answer a stats request")
            got = self._handle(take_messages(self.outbox, wait=0.05))
            assert not got, "worker_stats() between steps only"
        return self._stats

    @property
    def stats(self):
        "Counters the server's /metrics reads (from the front process: no round trip to the workers)."
        return dict(requests_in_flight=len(self.seqs), transfers_routed=len(self.routed),
                    blocks_total=self.cache.num_blocks)

    def close(self):
        "Stop both workers (idempotent); requests still in flight are aborted."
        for sid in list(self.seqs): self.abort(sid)
        self.closed = self.closed or "closed"
        self._finalizer()

    def __enter__(self): return self
    def __exit__(self, *exc): self.close()

def stop_workers(procs, queues, grace=5.0):
    "Ask each worker to stop, then terminate, then kill what is left; never wait without a limit."
    for r, p in procs.items():
        if p.is_alive():
            try: post(queues[ROLES.index(r)], "stop")
            except (OSError, ValueError): pass
    deadline = time.perf_counter() + grace
    for p in procs.values(): p.join(max(0.0, deadline - time.perf_counter()))
    for p in procs.values():
        if p.is_alive(): p.terminate()
        p.join(2)
        if p.is_alive(): p.kill()
        p.join(2)
    for q in queues:
        q.cancel_join_thread()  # never block interpreter exit on a message nobody will read
        q.close()
