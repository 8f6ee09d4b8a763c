"""The config the backbone-holding roles share: one check refuses what cannot run together,
at parse time, with a message that names the flags."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bus.config import COST_TABLE_OFF, BackboneConfig, HeadsConfig, load_config
from services.backbone.service import BackboneServiceConfig
from services.inferencer.config import InferencerConfig
from services.trainer.config import TrainerConfig
from vla import costmodel

HEAD_ROLES = [TrainerConfig, InferencerConfig]


@pytest.mark.parametrize("config", HEAD_ROLES, ids=lambda c: c.__name__)
def test_a_cost_table_with_the_backbone_role_is_refused_at_parse_time(
    config: type[HeadsConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        load_config(config, ["--backbone-service", "--cost-table", "measure"], env={}, prog="x")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "x: invalid configuration: --cost-table splits a resident backbone's forwards" in err
    assert "--backbone-service" in err and "?:" not in err
    with pytest.raises(ValidationError, match="--cost-table splits"):
        config(backbone_service=True, cost_table="costs.json")


@pytest.mark.parametrize("config", HEAD_ROLES, ids=lambda c: c.__name__)
def test_either_alone_is_accepted(config: type[HeadsConfig]) -> None:
    remote = load_config(config, ["--backbone-service"], env={})
    assert remote.backbone_service and remote.cost_table == costmodel.OFF
    split = load_config(config, [], env={"JOYNEXUS_COST_TABLE": costmodel.MEASURE})
    assert not split.backbone_service and split.cost_table == costmodel.MEASURE


def test_the_bus_config_means_the_cost_models_off() -> None:
    assert COST_TABLE_OFF == costmodel.OFF


def test_every_backbone_role_shares_the_backbone_fields() -> None:
    for config in (*HEAD_ROLES, BackboneServiceConfig):
        assert issubclass(config, BackboneConfig)
        parsed = load_config(config, ["--backbone", "tiny-224", "--dtype", "bfloat16"], env={})
        assert (parsed.backbone, parsed.dtype, parsed.device) == ("tiny-224", "bfloat16", "cpu")
    # The inferencer's answers wait on an encode, so it waits less than the trainer.
    assert InferencerConfig().encode_timeout_s < TrainerConfig().encode_timeout_s


def test_a_check_across_fields_prints_its_own_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        load_config(TrainerConfig, ["--feature-store-mb", "8"], env={}, prog="trainer")
    err = capsys.readouterr().err
    assert "trainer: invalid configuration: feature_store_mb: the feature cache's second tier" in (
        err
    )


def test_a_trainer_buffer_must_hold_more_than_its_prefetch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A buffer no larger than the prefetch would be full of fetched messages before one
    waited for an earlier step."""
    with pytest.raises(SystemExit):
        load_config(TrainerConfig, ["--max-buffered", "4"], env={}, prog="trainer")
    assert "max_buffered (4) must exceed prefetch (4)" in capsys.readouterr().err
