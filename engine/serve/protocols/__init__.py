"""Wire protocols beside OpenAI's chat and completions (engine/serve/protocol.py): each converts its request into the
engine's one chat request (engine/serve/protocol.py's ChatCompletionRequest: messages, sampling, structured outputs,
tools, reasoning budget) and the chat's answer and stream back into its own shapes, so no protocol has a copy of
sampling, templating or tool parsing. The platform reuses the same converters for its routes."""
