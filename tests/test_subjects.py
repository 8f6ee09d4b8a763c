"""Subject parsers: each is the inverse of its builder, and refuses every other subject."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import headers, subjects
from schemas.ids import ID_PATTERN
from schemas.subjects import SubjectError

ids = st.from_regex(ID_PATTERN, fullmatch=True)


@given(ids, ids, ids, st.sampled_from(subjects.JOB_VERBS))
def test_every_built_subject_parses_back_to_its_tokens(
    a: str, b: str, kind: str, verb: str
) -> None:
    assert subjects.parse_job(subjects.job(a, verb)) == (a, verb)
    assert subjects.parse_train(subjects.train(a, b)) == subjects.TrainSubject(a, b)
    assert subjects.tenant_of_train(subjects.train(a, b)) == b
    assert subjects.parse_infer(subjects.infer(a, b)) == subjects.InferSubject(a, b)
    assert subjects.parse_env(subjects.env(a, b)) == subjects.EnvSubject(a, b)
    assert subjects.parse_event(subjects.event(a, b, kind)) == (a, b, kind)
    assert subjects.parse_dead(subjects.dead(kind.upper(), a)) == (kind, a)


def test_parsed_tokens_are_named() -> None:
    ev = subjects.parse_event("nexus.event.acme.job-1.progress")
    assert (ev.tenant, ev.job_id, ev.kind) == ("acme", "job-1", "progress")
    tr = subjects.parse_train("nexus.train.tiny.acme")
    assert (tr.backbone, tr.tenant) == ("tiny", "acme")
    assert subjects.parse_job("nexus.job.acme.cancel").verb == "cancel"


@pytest.mark.parametrize(
    ("parse", "subject"),
    [
        (subjects.parse_train, "nexus.infer.tiny.acme"),  # another family
        (subjects.parse_train, "other.train.tiny.acme"),  # another prefix
        (subjects.parse_train, "nexus.train.acme"),  # a token short
        (subjects.parse_train, "nexus.train.tiny.acme.extra"),  # a token long
        (subjects.parse_train, "nexus.train.tiny.*"),  # a wildcard
        (subjects.parse_train, "nexus.train.tiny.Acme"),  # not an id
        (subjects.parse_infer, "nexus.infer..acme"),  # an empty token
        (subjects.parse_env, "nexus.env.acme"),
        (subjects.parse_event, "nexus.event.acme.job.>"),
        (subjects.parse_event, "nexus.event.acme.progress"),
        (subjects.parse_job, "nexus.job.acme.explode"),  # not a verb
        (subjects.parse_dead, "nexus.dead.train"),
        (subjects.parse_job, ""),
    ],
)
def test_a_subject_of_another_shape_is_refused(
    parse: Callable[[str], object], subject: str
) -> None:
    with pytest.raises(SubjectError):
        parse(subject)


def test_subject_errors_are_value_errors_naming_the_subject() -> None:
    with pytest.raises(ValueError, match=r"nexus\.train\.tiny\.Acme"):
        subjects.parse_train("nexus.train.tiny.Acme")


def test_header_names_are_the_ones_on_the_wire() -> None:
    # Nats-Msg-Id is JetStream's own name; changing ours would silently stop de-duplication.
    assert headers.MSG_ID == "Nats-Msg-Id"
    assert headers.JOB_ID == "Joynexus-Job-Id"
