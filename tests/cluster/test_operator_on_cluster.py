"""The scenarios of tests/operator/test_operator.py, collected here against a real cluster (those
that need the emulator's fault injection or its record of API calls are left there)."""

from tests.operator.test_operator import (  # noqa: F401 - collected by pytest
    p,
    svc,
    test_a_bad_service_is_degraded_with_an_event_and_others_carry_on,
    test_a_misspelt_kubernetes_field_is_an_invalid_spec,
    test_create_makes_the_owned_objects,
    test_delete_is_immediate,
    test_deployment_status_flows_into_the_service_status,
    test_hand_edits_are_reverted,
    test_model_change_rolls_the_deployment,
    test_production_pod_fields_reach_the_deployment,
    test_replicas_change_resizes_when_autoscaling_is_off,
)
