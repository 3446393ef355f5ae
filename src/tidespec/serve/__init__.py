"""The rooms of the two HTTP servers (`tidespec serve`: `server.build_app`; its SGLang front door:
`frontdoor.build_frontdoor`), after vLLM's `vllm/entrypoints/openai/`:

- `protocol`: the OpenAI request models (every field honoured or refused with a 400 naming it);
- `serving`: admission, waiting, aborts and accounting of OpenAI requests on the engine;
- `responses`: the one response envelope (whole responses and streamed chunks), choices, logprobs;
- `streaming`: server-sent events; `openai`: the routes;
- `errors`: OpenAI's error envelope, typed errors (4xx naming the field, 500 with a request id) and
  the exception handlers (both servers);
- `metrics`: what is counted (`FinishedRequestStats`) apart from the Prometheus exporters (both servers);
- `admin`: `POST /admin/draft` (bearer token) and the `ChampionWatcher`;
- `auth`: the API key of the OpenAI routes (`--api-key`, both servers), apart from the admin token;
- `engine_loop`: the thread that steps the engine;
- `textlog`: text capture of exchanges, `lifespan`: what closes at shutdown (both servers).
"""
