from tests.support.llm import llm, llm_server  # noqa: F401  (fixtures)
