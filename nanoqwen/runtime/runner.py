"""The CUDA engine's request loop: one request at a time over the shared sequence state
(runtime/state.py), the decode step (runtime/decoder.py) and the chunked prefill (runtime/prefill.py,
or ``by_steps`` through the decode step), which know nothing of each other.

A request: check it; take the kept sequence sharing the longest prefix, L positions, and pages for every
position the request may write (runtime/prefix_cache.py); copy its page table into the device table
the graph reads; prefill positions [L, P); decode. Greedy runs ``ahead`` steps in front of the token the
host is reading: after each step a 4-byte copy moves ``tokens_out[step]`` into pinned memory and records
an event, and the host only waits on the event of the oldest token it wants, never to decide what to
launch next. Host sampling (anything but plain greedy, runtime/sampler.py) and ``logits=True`` need the
host in the loop: each step's fp32 logits are downloaded and the sampled token is copied into ``state[0]``
for the next step.

Speculative decoding (``speculate``, a drafter setting of runtime/drafters.py; greedy requests without
``logits`` only, the others decode plainly) puts the host in the loop too: each round drafts from the
tokens so far, ``verify`` runs the last token and k drafts at positions p..p+k as k + 1 rows of one
multi-row step (runtime/rowstep.py, one captured graph per row bucket, every row bitwise a decode step
of its token), and the accepted tokens move the position to the first rejected slot, whose K/V later
writes overwrite. A round without drafts is a plain step; the plain steps the speculation commits to
(``Speculation.commit_plain``: those its cost rule chooses before it explores again) are launched ahead
like greedy's (``plain_steps``), not one host round trip each. Output is plain greedy decoding's, bit for
bit, by construction.

Closing the token iterator (EOS, Ctrl-C, a client gone) stops launching at once and drains what was
launched ahead; the sequence is then kept with exactly the positions whose K/V was written and whose
token the host knows. A request that fails keeps nothing."""

from __future__ import annotations

from .drafters import Speculation
from .generate import check_request
from .prefill import by_steps
from .prefix_cache import PrefixCache
from .sampler import HostSampler, Sampling


class Runner:
    """``prefiller`` None prefills through the decode step (``by_steps``); ``cache`` holds the kept
    sequences of the KV pool; ``context`` is the most positions one request may occupy."""

    def __init__(self, shared, decoder, prefiller, cache: PrefixCache, context: int, ahead: int = 8,
                 speculate=None, rows=None):
        self.shared, self.decoder, self.prefiller, self.cache = shared, decoder, prefiller, cache
        self.rows = rows   # the multi-row step (runtime/rowstep.py) the verify runs on
        self.dims, self.context, self.ahead = shared.dims, context, ahead
        self.speculate, self.spec = speculate, Speculation()
        self.cached_tokens = 0
        self.max_draft = rows.m - 1 if rows is not None else 0   # a verify's k + 1 rows are one step
        self.costs: dict[int, float] | None = None   # rows -> step time (ms), measured by the session

    def prefill(self, tokens: list[int], p0: int, read_token: bool = False, read_logits: bool = False) -> None:
        """Positions [p0, p1) of the loaded sequence (p1 = p0 + len(tokens); positions before p0 hold
        its K/V): afterwards tokens_out[p1 - 1] is the argmax after them and the device state is (that
        token, p1, p1), as after p1 decode steps; the token / logits are copied out on request (read-back
        slot p1 - 1)."""
        p1 = p0 + len(tokens)
        if self.prefiller is None:
            by_steps(self.decoder, tokens, p0, read_token, read_logits)
            return
        self.shared.reset(int(tokens[-1]), p1 - 1, p1 - 1)   # the lm_head below is "step p1 - 1"
        self.decoder.lm_head(self.prefiller(tokens, p0))
        self.shared.read_back(p1 - 1, read_token, read_logits)

    def verify(self, tokens: list[int], p: int) -> list[int]:
        """Positions p..p+k of the loaded sequence for ``tokens`` (the last accepted token and k drafts,
        1 <= k <= max_draft) as k + 1 rows of one multi-row step; waits for and returns the argmax after
        each, also left in the host's tok_out[p..p+k] as decode steps leave them."""
        out = self.shared.tok_out[p:p + len(tokens)]
        out[:] = self.rows.run(tokens, list(range(p, p + len(tokens))))
        return out.tolist()

    def plain_steps(self, k: int, end: int, launched: int):
        """Greedy decode steps k..end - 1 continuing the device state, ``ahead`` of the host (steps before
        ``launched`` are enqueued already): for each k, enqueue until the ``ahead`` steps after it are in
        flight, wait for step k's token alone and yield it with the positions enqueued so far."""
        for k in range(k, end):
            while launched < min(end, k + 1 + self.ahead):
                self.decoder.step(launched, read_token=True)
                launched += 1
            self.shared.wait_step(k)
            yield int(self.shared.tok_out[k]), launched

    def reserve(self, total: int) -> None:
        """Load pages for a fresh sequence of ``total`` positions, dropping every kept sequence (warm-up
        and tests that drive the steps themselves); the next request may reuse the pages."""
        self.shared.drain()
        self.cache.clear()
        lease = self.cache.start([], total)
        self.shared.kv.load(lease.pages, self.shared.stream)
        self.cache.keep(lease, [])

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 logits: bool = False):
        """Iterator of the ``max_new_tokens`` tokens after ``prompt`` ((token, logits) pairs with
        ``logits``); a bad request raises ContextError here, before anything runs."""
        check_request(self.dims, prompt, max_new_tokens, self.context)
        return self._run([int(t) for t in prompt], max_new_tokens, sampling, logits)

    def _run(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, logits: bool):
        sh, dec = self.shared, self.decoder
        P, total = len(prompt), len(prompt) + max_new_tokens - 1
        greedy, host = sampling.greedy, logits or not sampling.greedy
        sample = HostSampler(sampling, prompt)
        with self.cache.request(prompt, total) as lease:
            self.cached_tokens = lease.reused
            self.spec = spec = Speculation(self.speculate(prompt) if self.speculate and not host else None,
                                           self.costs)
            launched, gen, clean = lease.reused, [], False   # positions the enqueued work writes
            try:
                sh.drain()   # the previous request's work is done before its table is replaced
                sh.kv.load(lease.pages, sh.stream)
                self.prefill(prompt[lease.reused:], lease.reused, read_token=greedy, read_logits=host)
                launched = P
                if spec.drafter:   # speculative rounds; afterwards tok_out[P - 1 + i] == gen[i]
                    sh.wait_step(P - 1)
                    gen += spec.accept([], [int(sh.tok_out[P - 1])])   # the prefill's token, no drafts
                    yield gen[0]
                    while len(gen) < max_new_tokens:
                        limit = min(max_new_tokens - len(gen) - 1, self.max_draft)
                        n = spec.commit_plain(limit)
                        drafts = [] if n else spec.draft(limit)
                        if drafts:
                            block = spec.accept(drafts, self.verify([gen[-1]] + drafts, launched))
                            gen += block
                            launched = P + len(gen) - 1   # positions whose K/V holds an accepted token
                            yield from block
                        else:   # plain steps from the last token (a verify does not advance the decode state)
                            dec.reset(gen[-1], launched, launched)
                            for t, launched in self.plain_steps(launched, launched + max(n, 1), launched):
                                gen += spec.accept([], [t])
                                yield t
                elif host:   # the host samples, or reads the logits of, each step before the next
                    for k in range(P - 1, total):
                        if k >= launched:
                            dec.step(k, feed=None if greedy else gen[-1], read_token=greedy, read_logits=True)
                            launched += 1
                        sh.wait_step(k)
                        row = sh.logits()
                        gen.append(int(sh.tok_out[k]) if greedy else sample(row))
                        yield (gen[-1], row) if logits else gen[-1]
                else:
                    for t, launched in self.plain_steps(P - 1, total, launched):
                        yield t
                clean = True
            except GeneratorExit:   # closed early: the steps launched ahead still drain
                clean = True
                raise
            finally:
                sh.drain()
                if clean:   # the kernels' error flags, unless another error is already on its way out
                    sh.check_errors()
                    lease.tokens = prompt + (sh.tok_out[P - 1:launched - 1].tolist() if greedy else gen[:launched - P])
