"""The records every request builds take their fields through their slots' setters (``hicache_fsm.records``):
each ``__init__`` must take every field under its alias, with its default, and set it, and the record stays
frozen."""

from __future__ import annotations

import inspect

import attrs
import pytest
from hypothesis import given, strategies as st

from hicache_fsm.jobs import Completion, JobBatch, TransferJob, next_job_id
from hicache_fsm.results import InsertResult, MatchResult

RECORDS = (TransferJob, JobBatch, Completion, MatchResult, InsertResult)
NEW_ID = object()  # TransferJob's id: a factory, taken when ``id`` is None


def _declared(cls: type) -> list[tuple[str, object]]:
    """(alias, default) of each attrs field, in order (``inspect.Parameter.empty`` when required)."""
    out = []
    for f in attrs.fields(cls):
        if f.default is attrs.NOTHING:
            default = inspect.Parameter.empty
        elif isinstance(f.default, attrs.Factory):
            default = NEW_ID
        else:
            default = f.default
        out.append((f.alias, default))
    return out


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_each_init_takes_every_field_under_its_alias_with_its_default(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    taken = [(p.name, p.default) for p in params]
    declared = [(alias, None if default is NEW_ID else default) for alias, default in _declared(cls)]
    assert taken == declared


values = st.one_of(st.none(), st.integers(), st.text(max_size=4), st.tuples(st.integers()))


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@given(data=st.data())
def test_a_record_holds_what_it_was_built_with_and_stays_frozen(cls, data):
    fields = attrs.fields(cls)
    given_values = {f.alias: data.draw(values.filter(lambda v: v is not None) if f.name == "id" else values)
                    for f in fields}
    record = cls(**given_values)
    for f in fields:
        assert object.__getattribute__(record, f.name) == given_values[f.alias]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(record, fields[0].name, 1)
    again = attrs.evolve(record)
    assert [object.__getattribute__(again, f.name) for f in fields] == [given_values[f.alias] for f in fields]


def test_a_job_built_without_an_id_takes_a_new_one():
    first = TransferJob("d2h", (1,), None)
    second = TransferJob("d2h", (1,), None)
    assert first.id < second.id < next_job_id()
