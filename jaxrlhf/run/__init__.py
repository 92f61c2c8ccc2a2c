"""The run stack: a checked job built and run (RL or offline loop); see docs/ARCHITECTURE.md.

  check.py    the spec checked against files and devices: a `Job` (tokenizer, plan, data)
  lock.py     one run per workdir (a lock held for the life of the process)
  layouts.py  the placement resolved into a `RunPlan`: the planner's plan object, whatever
              `placement.kind` says (`execution_plan`), and its layouts on this machine
  build.py    engine calls, model states, runtimes, reward pools, the runner
  runner.py   one algorithm's graph run one step at a time (typed StepResult)
  loop.py     the one training loop every run shares (NaN guard, stop, checkpoint cadence,
              held-out evaluation, metrics), fed by a batch source
  guards.py   the NaN guard and the stop request (SIGTERM, Ctrl-C)
  rl.py       the job, RL or offline (SFT, reward modelling, DPO): its start, the synchronous
              batch source, the summary
  async_loop.py, async_procs.py  the asynchronous batch sources: a rollout worker in this
              process, generation processes elsewhere
  evaluate.py held-out evaluation of RL and offline runs
"""
