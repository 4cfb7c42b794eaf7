"""Online serving: the async engine front end, the OpenAI-compatible server and the load generator."""
