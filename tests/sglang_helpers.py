"""Helpers shared by the real-SGLang target's tests (test_sglang_target.py, test_sglang_pd.py,
test_sglang_hisparse.py)."""

from kvaudit.audit.runner import AuditedRun

CORES = ["rust", "python"]


def run_ops(config, ops):
    """Run ``ops`` until the first finding; returns (findings, the run) with the run still open for
    inspection (close it)."""
    run = AuditedRun(config)
    for op in ops:
        if run.apply(op):
            break
    return run.findings, run


def kinds(findings):
    return {(f.kind, f.pool) for f in findings}
