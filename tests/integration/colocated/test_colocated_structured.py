"""Structured output and tools on the colocated session cluster: the
disaggregated suite's tests, unchanged (one engine samples every token
under the grammar, the first one included)."""

from tests.integration.cluster.test_cluster_structured import (  # noqa: F401 - collected here
    test_bad_schema_is_400_naming_the_field,
    test_json_object_choice_and_regex,
    test_streamed_named_tool_call,
    test_tool_call_round_trip,
    test_twenty_schemas_parse_and_validate,
)
