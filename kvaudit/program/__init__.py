"""Programs: the ops (:mod:`.ops`), their schema (:mod:`.schema`), the generators' shared part
(:mod:`.generate`) and the byte decoder of coverage-guided fuzzers (:mod:`.bytes_program`, imported
on its own: it needs a target config)."""

from kvaudit.program.generate import make_op, random_op, random_program
from kvaudit.program.ops import (FORMAT, OP_TYPES, Abort, CloseSession, ContinueGeneration, FlushCache, HealthCheck,
                                 Idle, MemoryPressure, Op, OpenSession, PauseGeneration, ProgramError, Step, Submit,
                                 TransferFail, format_op, format_program, op_from_dict, op_to_dict, program_from_json,
                                 program_to_json)
from kvaudit.program.schema import (CAPABILITIES, FEATURES, OPS, PAUSE_MODES, Arg, OpSpec, pick, prompt_tokens,
                                    resolve_submit)
