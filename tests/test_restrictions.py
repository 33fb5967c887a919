"""The resources eugo's device tasks ask for, beside the user's own (the cluster tests in
test_cluster.py run them on separate-process clusters)."""

from __future__ import annotations

from eugo_dask.rewrite import TaskRoles

ROLES = {("gpu", 0): ("gpu", 1.0, 0.1), ("gpu", 1): ("gpu", 1.0, 0.1),
         ("copy", 0): ("todevice", None, None), ("host", 0): ("host", 1.0, 1.0)}
#: per-key resources the user annotated, and those around compute (dask.annotate)
OWN = {"resources": {("gpu", 0): {"MEM": 2}, ("host", 0): {"MEM": 2}}}
AROUND = {"MEM": 1}


def resources(roles):
    return {key: roles.value("resources", key) for key in ROLES}


def test_the_pass_asks_beside_the_users_resources_as_dask_applies_them():
    # a task's own annotation replaces the global one in Dask: it is not merged with it
    assert resources(TaskRoles(ROLES, "GPU", OWN, AROUND)) == {
        ("gpu", 0): {"GPU": 1, "MEM": 2}, ("gpu", 1): {"GPU": 1, "MEM": 1},
        ("copy", 0): {"GPU": 0, "MEM": 1}, ("host", 0): {"MEM": 2}}
    # (a copy goes to GPU workers without holding the slot; the user's own count wins)
    assert resources(TaskRoles(ROLES, "GPU", {}, {"GPU": 2})) == {
        ("gpu", 0): {"GPU": 2}, ("gpu", 1): {"GPU": 2}, ("copy", 0): {"GPU": 2},
        ("host", 0): None}


def test_where_the_plugin_asks_the_tasks_carry_only_the_users_own():
    roles = TaskRoles(ROLES, None, OWN, AROUND)
    # the global annotations (around compute, client.compute(resources=...)) then apply as
    # they do in plain Dask, and the plugin adds the GPU's to them
    assert resources(roles) == {("gpu", 0): {"MEM": 2}, ("gpu", 1): None, ("copy", 0): None,
                                ("host", 0): {"MEM": 2}}
    assert "resources" in roles.annotations()
    assert "resources" not in TaskRoles(ROLES, None).annotations()
