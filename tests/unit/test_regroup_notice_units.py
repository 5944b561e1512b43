"""The rule behind the notice a survivor prints after ``%clorch restart --ranks`` (the sessions:
tests/integration/test_regroup_notice.py): the groups the user made are named by their ranks and
how they were made, clorch's own (marked by their torch description) never are."""

from __future__ import annotations

from clorch_repl.kernel.group import clorch_made, left_behind_notice, maker
from clorch_repl.training.checkpoint.ranks import GROUP_DESC


def test_the_checkpoints_group_is_clorchs_own_and_alone_gives_no_notice() -> None:
    assert clorch_made(GROUP_DESC)  # the mark the checkpoint code gives its group is the one recognised
    assert not clorch_made("undefined") and not clorch_made("mesh_dp") and not clorch_made(None)
    assert left_behind_notice([([0, 1], GROUP_DESC)]) == ""
    assert left_behind_notice([]) == ""


def test_the_users_groups_are_named_by_ranks_and_maker() -> None:
    notice = left_behind_notice([([0, 1], GROUP_DESC), ([0, 1], "undefined")])
    assert notice == ("clorch: not carried over to the re-formed group: the group of ranks [0, 1] made by "
                      "dist.new_group. Make it again on every rank (dist.new_group, init_device_mesh) before using it.")
    notice = left_behind_notice([([0, 2], "mesh_dp"), ([0, 2], "mesh_dp"), ([0, 1], "undefined")])
    assert "2 groups of ranks [0, 2] made by init_device_mesh (its dimension 'dp'); the group of ranks [0, 1]" in notice
    assert "Make them again" in notice and "'1'" not in notice


def test_how_a_group_was_made_is_read_from_its_description() -> None:
    assert maker("undefined") == maker(None) == maker("") == "dist.new_group"
    assert maker("mine") == "dist.new_group (group_desc='mine')"
    assert maker("mesh_default") == "init_device_mesh"
    assert maker("mesh_dim_1") == "init_device_mesh (its dimension 1)"
    assert maker("mesh_tp") == "init_device_mesh (its dimension 'tp')"
