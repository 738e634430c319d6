"""Pipeline parallel over 2 real processes: each schedule against the unpipelined GPT."""

import pytest

import disttrain
from disttrain.mesh import Mesh
from disttrain.testing import spawn
from tests.dist import _gpt_ref as ref

CASES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 3, 1), ("interleaved", 4, 2)]


def pipeline_schedules():
    mesh = Mesh(pp=2)
    expected = ref.reference(batch=12) if disttrain.rank() == 0 else None
    spans = {}
    for schedule, m, v in CASES:
        out = ref.run_parallel(mesh, batch=12, schedule=schedule, microbatches=m,
                               num_virtual=v)
        if disttrain.rank() == 0:
            ref.assert_matches_reference(out, expected)
            pipe = out[3].pipeline
            spans[schedule] = [(s.kind, s.microbatch, s.chunk) for s in pipe.spans]
            expected_order = [(a.kind, a.microbatch, a.chunk) for a in pipe.actions]
            assert spans[schedule] == expected_order
            assert all(s.end >= s.start >= 0 for s in pipe.spans)
    return spans


@pytest.mark.timeout(120)
def test_every_schedule_matches_unpipelined_model():
    spans = spawn(pipeline_schedules, 2, timeout=110)[0]
    assert spans["gpipe"][:4] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0)]
    assert {c for _, _, c in spans["interleaved"]} == {0, 1}
