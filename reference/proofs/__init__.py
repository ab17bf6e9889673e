"""Z3 proofs about the reference policies: the encoded step of ``policies.plan_step`` (fcfs, static,
shortest-prompt-first), the trace properties they declare, and counterexamples turned into
replayable scenarios. See ``docs/proofs.md``. Every module here imports z3."""
