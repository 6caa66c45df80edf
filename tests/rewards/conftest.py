from tests.llm.fake_server import llm, llm_server  # noqa: F401  (fixtures)
