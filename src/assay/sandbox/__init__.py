"""Running untrusted programs: isolation, resource limits, timeouts, output caps, worker pool.

    >>> from assay.sandbox import Job, Limits, SandboxPool, language
    >>> pool = SandboxPool(workers=1)                                      # doctest: +SKIP
    >>> job = Job(language("python"), "print(input())", "stdio", [{"input": "hi"}])
    >>> pool.run([job])[0].cases[0].stdout                                 # doctest: +SKIP
    b'hi\\n'

Python programs run in each worker's fork server (`forkserver`: one pre-loaded interpreter
in the sandbox, a fresh child per program); `SandboxPool(fork_server=False)` starts a fresh
sandbox per program instead. A check test (`check.CheckSpec`) runs its function here, in
the trusted process, and calls the program by value. See docs/sandbox.md for what is
isolated and how, and `isolation` for the opt-out.
"""

from assay.sandbox.check import CheckSpec
from assay.sandbox.forkserver import ForkServer
from assay.sandbox.isolation import UNSAFE_ENV, Isolation, detect
from assay.sandbox.languages import LANGUAGES, language
from assay.sandbox.pool import SandboxPool, WorkerFailure, WorkerPool, shared_pool
from assay.sandbox.runner import CaseRecord, Job, Limits, ProgramResult

__all__ = ["UNSAFE_ENV", "Isolation", "detect", "LANGUAGES", "language", "SandboxPool", "WorkerFailure",
           "WorkerPool", "shared_pool", "CaseRecord", "Job", "Limits", "ProgramResult", "CheckSpec", "ForkServer"]
