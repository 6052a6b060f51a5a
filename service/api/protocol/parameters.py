"""Every request field of every route, and what the server does with it: honoured (and which test shows its
effect) or refused with a 4xx naming it. A field a model does not declare is refused by name
(service/api/protocol/common.py RequestModel); tests/service/api/test_parameter_table.py checks that every declared
field of every request model has a row here, that every row names a field and a test that exists, and that
docs/API.md holds the table `render_markdown` writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["honoured", "refused"]


@dataclass(frozen=True)
class Parameter:
    """`status` honoured: the server does what the field asks (within the limits `meaning` names); refused:
    any value but the one that asks for nothing is answered with a 4xx naming the field. `shown_by`: the tests
    (`file::function` under tests/) that show the effect or the refusal."""

    status: Status
    meaning: str
    shown_by: tuple[str, ...]


def _h(meaning: str, *tests: str) -> Parameter:
    return Parameter("honoured", meaning, tests)


def _r(meaning: str, *tests: str) -> Parameter:
    return Parameter("refused", meaning, tests)


_SAMPLING = "service/api/test_sampling_params.py"
_EFFECTS = "service/api/test_parameter_effects.py"
_LOGPROBS = "service/api/test_logprobs.py"
_CAUSAL_SCORES = "service/api/test_causal_scoring.py"
_SHAPES = "service/api/test_api_shapes.py"
_ROUTES = "service/api/test_routes.py"
_BAD = "service/api/test_bad_inputs.py"
_CHAT = "service/api/test_chat.py"
_TOKENS = "service/api/test_tokenizer_routes.py"
_AS_COMPLETIONS = f"{_CHAT}::test_chat_takes_each_sampling_field_as_completions_does"
_PREFIX = "service/prefix_cache/test_prefix_cache.py"
_SALT = "service/prefix_cache/test_cache_salt.py"
_STRUCTURED = "service/api/test_structured_routes.py"
_STRUCTURED_LIMITS = "service/api/test_structured_limits.py"

# The routes each request model is the body (or part of the body) of.
ROUTES: dict[str, str] = {
    "GenerateRequest": "POST /generate, /generate_stream, / (TGI)",
    "GenerateParameters": "`parameters` of POST /generate, /generate_stream, / (TGI)",
    "CompletionRequest": "POST /v1/completions (OpenAI, vLLM's extras)",
    "StreamOptions": "`stream_options` of POST /v1/completions",
    "EmbedRequest": "POST /embed (TEI)",
    "EmbeddingsRequest": "POST /v1/embeddings (OpenAI)",
    "ChatCompletionRequest": "POST /v1/chat/completions (OpenAI, vLLM's extras)",
    "ChatMessage": "each of `messages` (chat, and /tokenize with messages)",
    "TextPart": "each part of a message's `content` given as a list",
    "TokenizeBody": "POST /tokenize (TGI's body with inputs, vLLM's with prompt or messages)",
    "DetokenizeRequest": "POST /detokenize (vLLM)",
}

PARAMETERS: dict[str, dict[str, Parameter]] = {
    "GenerateRequest": {
        "inputs": _h("The prompt.", f"{_ROUTES}::test_generate_returns_text_details_and_timing_headers"),
        "parameters": _h("TGI's generation parameters (below).",
                         f"{_ROUTES}::test_generate_returns_text_details_and_timing_headers"),
        "stream": _h("On POST /: true streams as /generate_stream, false answers as /generate in a one-element "
                     "list; /generate and /generate_stream refuse a value that contradicts them.",
                     f"{_SHAPES}::test_tgi_root_answers_a_one_element_list_or_a_stream",
                     f"{_SAMPLING}::test_best_of_is_refused_when_streaming"),
    },
    "GenerateParameters": {
        "cache_prefix_chars": _h("Extension: the input's first N characters are its cached segment (prefilled "
                                 "alone and kept in the prefix cache, the rest read as decode steps); refused "
                                 "out of range or with truncate or decoder_input_details.",
                                 f"{_PREFIX}::test_a_declared_prefix_is_reused_and_the_answer_is_what_a_cold_server_gives",
                                 f"{_PREFIX}::test_a_bad_cache_prefix_is_refused_by_name"),
        "cache_salt": _h("Extension (vLLM's): the prefix-cache isolation key; with the X-Cache-Salt header, "
                         "prompts share kept states, in-flight prefills and cached_tokens only under equal salts; "
                         "refused unless 1-256 characters of [A-Za-z0-9._:/+=@-].",
                          f"{_SALT}::test_two_salts_never_share_a_hit_or_a_report",
                          f"{_SALT}::test_a_bad_salt_is_refused_naming_the_field"),
        "best_of": _h("Samples this many sequences (at most /info's max_best_of; needs sampling; not when "
                      "streaming), answers the one of the highest summed logprob, the others in "
                      "details.best_of_sequences; each sequence's seed derives from `seed`.",
                      f"{_SAMPLING}::test_tgi_best_of_returns_the_others_in_details"),
        "max_new_tokens": _h("Tokens to generate at most.",
                             f"{_ROUTES}::test_generate_returns_text_details_and_timing_headers"),
        "temperature": _h("Divides the logits; != 1 samples (TGI's warper rule).",
                          f"{_SAMPLING}::test_a_tgi_warper_samples_without_do_sample"),
        "top_k": _h("Keeps the k likeliest tokens; > 0 samples.",
                    f"{_SAMPLING}::test_a_tgi_warper_samples_without_do_sample"),
        "top_p": _h("Nucleus filter; < 1 samples.", f"{_SAMPLING}::test_a_tgi_warper_samples_without_do_sample"),
        "typical_p": _h("Typical filter (transformers' TypicalLogitsWarper); < 1 samples.",
                        f"{_SAMPLING}::test_a_tgi_warper_samples_without_do_sample",
                        "model/test_sampling.py::test_typical_p_matches_transformers_typical_warper"),
        "repetition_penalty": _h("CTRL penalty on the tokens of prompt and generation.",
                                 f"{_EFFECTS}::test_repetition_penalty_changes_a_repetitive_greedy_text"),
        "frequency_penalty": _h("Subtracted per earlier occurrence in the generated tokens.",
                                f"{_SAMPLING}::test_penalties_change_a_repetitive_greedy_text"),
        "do_sample": _h("Samples; false with no warper set picks the likeliest token.",
                        f"{_SAMPLING}::test_a_tgi_warper_samples_without_do_sample"),
        "seed": _h("The sampler's seed: same seed, same tokens; reported in details.seed.",
                   f"{_ROUTES}::test_generate_is_deterministic_with_a_seed"),
        "stop": _h("Ends the generation once its text ends with one (kept in the text, as TGI); the last "
                   "token is checked too (finish_reason stop_sequence).",
                   f"{_EFFECTS}::test_stop_sequences_end_the_text_on_both_routes",
                   f"{_EFFECTS}::test_a_stop_sequence_in_the_last_token_ends_the_text_there",
                   "service/text/test_detokenize.py::test_tgi_stops_only_where_the_text_ends_with_the_stop_openai_anywhere_in_the_token"),
        "truncate": _h("Keeps the last N input tokens (true: as many as fit).",
                       f"{_BAD}::test_input_over_the_token_limit_with_truncation"),
        "details": _h("Adds finish reason, token counts, seed and tokens.",
                      f"{_ROUTES}::test_generate_returns_text_details_and_timing_headers"),
        "decoder_input_details": _h("With details: details.prefill, each input token's logprob from the "
                                    "prefill, with the semantics it reads the prompt with (the first null); "
                                    "refused when streaming (as TGI).",
                                    f"{_LOGPROBS}::test_tgi_top_n_tokens_and_prefill_details",
                                    f"{_CAUSAL_SCORES}::test_tgi_decoder_input_details",
                                    f"{_SAMPLING}::test_best_of_is_refused_when_streaming"),
        "top_n_tokens": _h("The N likeliest alternatives of each generated token (at most 20): details.top_tokens, "
                           "each stream event's top_tokens.",
                           f"{_LOGPROBS}::test_tgi_top_n_tokens_and_prefill_details",
                           f"{_LOGPROBS}::test_tgi_stream_events_carry_top_tokens"),
        "return_full_text": _h("Prepends the prompt to generated_text.",
                               f"{_ROUTES}::test_generate_return_full_text_prepends_the_prompt"),
        "ignore_eos": _h("Generates past the end-of-text token.",
                         f"{_EFFECTS}::test_ignore_eos_generates_past_the_end_of_text"),
        "watermark": _r("true is refused: no watermarking.",
                        f"{_SAMPLING}::test_tgi_refuses_what_it_cannot_honour_by_name"),
        "grammar": _h("Structured output: {type: json, value: schema} (json_object its alias), {type: "
                      "json_schema, value: {name, schema}} or {type: regex, value: pattern}; the text matches it "
                      "(finish eos_token once complete, length if the budget ends first); a constraint the engine "
                      "cannot compile, or within the server's size and time limits, is refused naming it.",
                      f"{_STRUCTURED}::test_tgi_grammar_constrains_generate",
                      f"{_STRUCTURED}::test_huggingface_hubs_inference_client_sends_a_grammar",
                      f"{_SAMPLING}::test_tgi_refuses_what_it_cannot_honour_by_name",
                      f"{_STRUCTURED_LIMITS}::test_a_schema_the_engine_cannot_compile_is_refused_naming_the_construct"),
        "adapter_id": _r("Any adapter is refused: none are served.",
                         f"{_SAMPLING}::test_tgi_refuses_what_it_cannot_honour_by_name"),
    },
    "CompletionRequest": {
        "cache_prefix_chars": _h("Extension, as TGI's parameters.cache_prefix_chars; text prompts only.",
                                 f"{_PREFIX}::test_a_declared_prefix_is_reused_and_the_answer_is_what_a_cold_server_gives",
                                 f"{_PREFIX}::test_completions_refuse_a_cache_prefix_on_token_prompts"),
        "cache_salt": _h("Extension (vLLM's), as TGI's parameters.cache_salt.",
                          f"{_SALT}::test_two_salts_never_share_a_hit_or_a_report",
                          f"{_SALT}::test_a_bad_salt_is_refused_naming_the_field"),
        "model": _h("Must be the served model's id (/v1/models) when given; any other is 404 model_not_found, before "
                    "anything is tokenized.",
                    f"{_SHAPES}::test_openai_model_names_this_servers_model_or_is_not_found",
                    f"{_CHAT}::test_the_model_is_checked_before_anything_is_tokenized"),
        "prompt": _h("A text, a list of texts, token ids or lists of token ids.",
                     f"{_ROUTES}::test_v1_completions_several_prompts"),
        "suffix": _r("Any suffix is refused: this model does not insert.",
                     f"{_SHAPES}::test_openai_refuses_what_it_cannot_honour_by_name"),
        "max_tokens": _h("Tokens to generate at most (16 unset); 0 with echo scores the prompt only.",
                         f"{_ROUTES}::test_v1_completions_and_stream_end_with_done",
                         f"{_LOGPROBS}::test_echo_with_max_tokens_0_scores_the_prompt_as_its_prefill_reads_it"),
        "temperature": _h("0 is greedy; > 0 samples at that temperature.",
                          f"{_SAMPLING}::test_openai_temperature_0_is_greedy"),
        "top_p": _h("Nucleus filter.", f"{_EFFECTS}::test_top_k_1_and_a_tiny_top_p_keep_only_the_likeliest_token"),
        "top_k": _h("Keeps the k likeliest tokens (0 or -1: all).",
                    f"{_EFFECTS}::test_top_k_1_and_a_tiny_top_p_keep_only_the_likeliest_token"),
        "repetition_penalty": _h("CTRL penalty (vLLM's extra).",
                                 f"{_EFFECTS}::test_repetition_penalty_changes_a_repetitive_greedy_text"),
        "frequency_penalty": _h("Subtracted per earlier occurrence in the generated tokens.",
                                f"{_SAMPLING}::test_penalties_change_a_repetitive_greedy_text"),
        "presence_penalty": _h("Subtracted once a token has been generated.",
                               f"{_SAMPLING}::test_penalties_change_a_repetitive_greedy_text"),
        "logit_bias": _h("Token id -> value in [-100, 100] added to its logit; other keys are refused.",
                         f"{_SAMPLING}::test_logit_bias_forces_and_forbids_tokens",
                         f"{_SAMPLING}::test_bad_logit_bias_is_refused_by_name"),
        "n": _h("Choices per prompt (at most max_best_of), seeds derived from `seed` (response `seeds`); a "
                "stream takes n=1.", f"{_SAMPLING}::test_n_choices_are_each_reproduced_alone"),
        "best_of": _h("Generates this many per prompt (>= n) and answers the n of the highest summed logprob; "
                      "not when streaming.", f"{_SAMPLING}::test_best_of_answers_the_highest_summed_logprob"),
        "stream": _h("Server-Sent Events ending with [DONE].",
                     f"{_ROUTES}::test_v1_completions_and_stream_end_with_done"),
        "stream_options": _h("include_usage: a last chunk with usage (needs stream).",
                             f"{_LOGPROBS}::test_a_stream_carries_the_same_logprobs_and_ends_with_usage"),
        "logprobs": _h("Each token's logprob and its N likeliest alternatives (N <= 20), streams too.",
                       f"{_LOGPROBS}::test_logprobs_up_to_20_alternatives_and_refused_beyond"),
        "echo": _h("Prepends the prompt; with logprobs its tokens are scored by the prefill (the first null).",
                   f"{_LOGPROBS}::test_echo_with_max_tokens_0_scores_the_prompt_as_its_prefill_reads_it",
                   f"{_CAUSAL_SCORES}::test_echo_scores_are_the_decode_steps"),
        "stop": _h("Ends the generation at a stop sequence anywhere in a token's text, left out of the text "
                   "with what follows it; the last token is checked too (finish_reason stop, as vLLM).",
                   f"{_EFFECTS}::test_stop_sequences_end_the_text_on_both_routes",
                   f"{_EFFECTS}::test_a_stop_sequence_in_the_last_token_ends_the_text_there"),
        "seed": _h("The sampler's seed (choice i of n: derived from it).",
                   f"{_SAMPLING}::test_n_choices_are_each_reproduced_alone"),
        "ignore_eos": _h("Generates past the end-of-text token (vLLM's extra).",
                         f"{_EFFECTS}::test_ignore_eos_generates_past_the_end_of_text"),
        "truncate_prompt_tokens": _h("Keeps the last N prompt tokens (vLLM's extra).",
                                     f"{_EFFECTS}::test_truncate_prompt_tokens_keeps_the_last_tokens"),
        "user": _h("The end user's id, written into the request's log line.",
                   f"{_SHAPES}::test_openai_user_goes_into_the_request_log"),
    },
    "StreamOptions": {
        "include_usage": _h("Ends the stream with a chunk holding usage and no choices.",
                            f"{_LOGPROBS}::test_a_stream_carries_the_same_logprobs_and_ends_with_usage"),
    },
    "EmbedRequest": {
        "inputs": _h("A text or a list of texts, one vector each.", f"{_ROUTES}::test_embed_single_and_list"),
        "normalize": _h("L2-normalises each vector (default true).",
                        f"{_EFFECTS}::test_embed_normalize_false_keeps_the_raw_length"),
        "truncate": _h("Keeps max_input_tokens tokens of a longer input.",
                       f"{_BAD}::test_input_over_the_token_limit_with_truncation"),
        "truncation_direction": _h("right keeps the first tokens, left the last.",
                                   f"{_SHAPES}::test_tei_truncation_direction_keeps_the_chosen_end"),
        "prompt_name": _r("Any name is refused: no named prompts.",
                          f"{_SHAPES}::test_tei_truncation_direction_keeps_the_chosen_end"),
        "pooling": _h("mean (whitened with the artifact's statistics when it ships them) or last.",
                      f"{_ROUTES}::test_embed_single_and_list",
                      "service/api/test_embed_standardize.py::test_mean_embeddings_are_whitened_before_normalisation"),
    },
    "EmbeddingsRequest": {
        "input": _h("A text or a list of texts.", f"{_ROUTES}::test_v1_embeddings_float_and_base64_agree"),
        "model": _h("Must be the served model's id when given; any other is 404 model_not_found, before "
                    "anything is tokenized.",
                    f"{_SHAPES}::test_openai_model_names_this_servers_model_or_is_not_found",
                    f"{_CHAT}::test_the_model_is_checked_before_anything_is_tokenized"),
        "encoding_format": _h("float or base64 (little-endian float32).",
                              f"{_ROUTES}::test_v1_embeddings_float_and_base64_agree"),
        "dimensions": _h("Must be the model's dimension when given; any other is refused.",
                         f"{_EFFECTS}::test_embeddings_dimensions_must_be_the_models"),
        "user": _h("The end user's id, written into the request's log line.",
                   f"{_SHAPES}::test_openai_user_goes_into_the_request_log"),
    },
    "ChatCompletionRequest": {
        "cache_prefix_messages": _h("Extension: the first N messages, rendered alone, are the prompt's cached "
                                    "segment (as cache_prefix_chars); refused past the message count or when the "
                                    "template does not render them as the prompt's start.",
                                    f"{_PREFIX}::test_a_chat_keeps_its_first_messages_cached_across_turns"),
        "cache_salt": _h("Extension (vLLM's), as TGI's parameters.cache_salt.",
                          f"{_SALT}::test_two_salts_never_share_a_hit_or_a_report",
                          f"{_SALT}::test_a_bad_salt_is_refused_naming_the_field"),
        "messages": _h("The conversation, rendered with the artifact's chat template; without one, 400 naming it.",
                       f"{_CHAT}::test_chat_answers_what_completions_answers_for_the_rendered_prompt",
                       f"{_CHAT}::test_without_a_template_chat_answers_400_naming_it"),
        "add_generation_prompt": _h("Ends the prompt with the template's opening of an assistant turn (default "
                                    "true).", f"{_CHAT}::test_template_options_shape_the_chat_prompt"),
        "continue_final_message": _h("Leaves the last (assistant) message open for the model to continue; needs "
                                     "add_generation_prompt false.",
                                     f"{_CHAT}::test_template_options_shape_the_chat_prompt"),
        "chat_template_kwargs": _h("Further template variables (text, as the messages; at most 32 levels deep); "
                                   "those the server sets are refused by name.",
                                   f"{_CHAT}::test_template_options_shape_the_chat_prompt",
                                   f"{_CHAT}::test_template_variables_come_from_chat_template_kwargs"),
        "model": _h("Must be the served model's id when given; any other is 404 model_not_found, before "
                    "anything is tokenized.",
                    f"{_CHAT}::test_chat_names_this_servers_model_or_is_not_found",
                    f"{_CHAT}::test_the_model_is_checked_before_anything_is_tokenized"),
        "max_tokens": _h("Tokens to generate at most (max_completion_tokens' older name; both must agree).",
                         f"{_CHAT}::test_chat_answers_what_completions_answers_for_the_rendered_prompt"),
        "max_completion_tokens": _h("Tokens to generate at most; unset (max_tokens too), the room the prompt "
                                    "leaves in the model's positions, at most the server's max_new_tokens (as "
                                    "vLLM; not OpenAI's 16 of /v1/completions).",
                                    f"{_CHAT}::test_max_completion_tokens_and_text_parts",
                                    f"{_CHAT}::test_chat_without_a_token_limit_generates_into_the_room_left"),
        "temperature": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "top_p": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "top_k": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "repetition_penalty": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "frequency_penalty": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "presence_penalty": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "logit_bias": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "n": _h("As in /v1/completions: n choices, each a message.", _AS_COMPLETIONS),
        "stream": _h("chat.completion.chunk events, the role in each choice's first delta, ending with [DONE].",
                     f"{_CHAT}::test_chat_streams_chunks_with_the_role_first"),
        "stream_options": _h("include_usage: a last chunk with usage and no choices.",
                             f"{_CHAT}::test_chat_streams_chunks_with_the_role_first"),
        "logprobs": _h("Each generated token's logprob, in chat's per-token shape.",
                       f"{_CHAT}::test_chat_logprobs_come_per_token"),
        "top_logprobs": _h("Its N likeliest alternatives per token (N <= 20; needs logprobs).",
                           f"{_CHAT}::test_chat_logprobs_come_per_token"),
        "stop": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "seed": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "ignore_eos": _h("As in /v1/completions.", _AS_COMPLETIONS),
        "truncate_prompt_tokens": _h("Keeps the last N tokens of the rendered prompt.", _AS_COMPLETIONS),
        "user": _h("As in /v1/completions: written into the request's log line.", _AS_COMPLETIONS),
    },
    "ChatMessage": {
        "role": _h("system, developer, user, assistant or tool, as the template sees it; any other is refused.",
                   f"{_CHAT}::test_chat_answers_what_completions_answers_for_the_rendered_prompt",
                   f"{_CHAT}::test_bad_chat_requests_are_refused_by_name"),
        "content": _h("A text, or a list of text parts joined with newlines (as vLLM joins them).",
                      f"{_CHAT}::test_max_completion_tokens_and_text_parts"),
        "name": _h("Passed to the template as the message's `name`.",
                   f"{_CHAT}::test_template_options_shape_the_chat_prompt"),
    },
    "TextPart": {
        "type": _h("Only text: image and audio parts are refused by name.",
                   f"{_CHAT}::test_bad_chat_requests_are_refused_by_name"),
        "text": _h("The part's text.", f"{_CHAT}::test_max_completion_tokens_and_text_parts"),
    },
    "TokenizeBody": {
        "inputs": _h("TGI: the tokens with their text and character offsets.",
                     f"{_TOKENS}::test_tgi_tokenize_keeps_its_shape"),
        "prompt": _h("vLLM: tokens, count and max_model_len; a special token spelled out is its id.",
                     f"{_TOKENS}::test_vllm_tokenize_answers_ids_count_and_model_length",
                     f"{_TOKENS}::test_special_tokens_spelled_in_a_vllm_prompt_are_their_ids"),
        "messages": _h("vLLM: the conversation rendered with the chat template, then tokenized.",
                       f"{_CHAT}::test_tokenize_with_messages_uses_the_same_template"),
        "add_special_tokens": _h("Puts the beginning-of-text id first when the tokenizer has one (the byte "
                                 "tokenizer has none).",
                                 f"{_TOKENS}::test_add_special_tokens_puts_the_beginning_of_text_id_first_when_there_is_one"),
        "add_generation_prompt": _h("With messages: as in chat.",
                                    f"{_CHAT}::test_tokenize_with_messages_uses_the_same_template"),
        "continue_final_message": _h("With messages: as in chat.",
                                     f"{_CHAT}::test_tokenize_with_messages_uses_the_same_template"),
        "chat_template_kwargs": _h("With messages: as in chat.",
                                   f"{_CHAT}::test_template_variables_come_from_chat_template_kwargs"),
        "return_token_strs": _h("Adds each token's text (token_strs).",
                                f"{_TOKENS}::test_vllm_tokenize_answers_ids_count_and_model_length"),
        "model": _h("Must be the served model's id when given; any other is 404 model_not_found.",
                    f"{_TOKENS}::test_tokenizer_routes_name_this_servers_model_or_are_not_found"),
    },
    "DetokenizeRequest": {
        "tokens": _h("The ids' text (special ids give none); ids outside the vocabulary are refused by position.",
                     f"{_TOKENS}::test_detokenize_inverts_tokenize",
                     f"{_TOKENS}::test_detokenize_refuses_ids_outside_the_vocabulary_or_not_ids"),
        "model": _h("Must be the served model's id when given; any other is 404 model_not_found.",
                    f"{_TOKENS}::test_tokenizer_routes_name_this_servers_model_or_are_not_found"),
    },
}


# Structured output's fields (service/api/protocol/structured.py), the same on /v1/completions and on
# /v1/chat/completions, which passes them on to it.
_OPENAI_STRUCTURED = {
    "response_format": _h("{type: json_object}: any JSON object; {type: json_schema, json_schema: {name, schema}}: "
                          "JSON matching the schema; {type: text}: unconstrained. Compact JSON (no whitespace "
                          "between tokens); finish stop once complete, length if the budget ends first.",
                          f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes",
                          f"{_STRUCTURED}::test_json_object_is_any_object_even_against_a_bias",
                          f"{_STRUCTURED}::test_the_openai_client_sends_response_format"),
    "structured_outputs": _h("vLLM's: one of json (a schema, object or JSON text), regex, choice, grammar (Lark "
                             "or GBNF) or json_object.",
                             f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
    "guided_json": _h("vLLM's older name of structured_outputs.json.",
                      f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
    "guided_regex": _h("vLLM's older name of structured_outputs.regex.",
                       f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes",
                       f"{_STRUCTURED}::test_streams_carry_the_constrained_text"),
    "guided_choice": _h("vLLM's older name of structured_outputs.choice.",
                        f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
    "guided_grammar": _h("vLLM's older name of structured_outputs.grammar.",
                         f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
}
_ONE_AT_MOST = f"{_STRUCTURED_LIMITS}::test_two_structured_fields_at_once_are_refused"
PARAMETERS["CompletionRequest"].update(_OPENAI_STRUCTURED)
PARAMETERS["ChatCompletionRequest"].update(_OPENAI_STRUCTURED)
ROUTES.update({
    "ResponseFormat": "`response_format` of POST /v1/completions and /v1/chat/completions",
    "JsonSchemaFormat": "`response_format.json_schema`",
    "StructuredOutputs": "`structured_outputs` of POST /v1/completions and /v1/chat/completions (vLLM)",
    "TGIGrammar": "`parameters.grammar` of POST /generate, /generate_stream, / (TGI)",
})
PARAMETERS.update({
    "ResponseFormat": {
        "type": _h("text, json_object or json_schema.",
                   f"{_STRUCTURED}::test_json_object_is_any_object_even_against_a_bias"),
        "json_schema": _h("With type json_schema (and only with it): the schema.", _ONE_AT_MOST),
    },
    "JsonSchemaFormat": {
        "name": _h("Accepted; not used.", f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
        "description": _h("Accepted; not used.",
                          f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
        "json_schema": _h("`schema` on the wire: the JSON schema the output matches.",
                          f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
        "strict": _h("Accepted; the output always matches the schema, strict or not.",
                     f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
    },
    "StructuredOutputs": {
        "json_": _h("`json` on the wire: a JSON schema, as an object or its JSON text.",
                    f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
        "regex": _h("A regular expression (Rust regex syntax) the whole text matches.",
                    f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
        "choice": _h("The text is exactly one of these strings.",
                     f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
        "grammar": _h("A Lark grammar (llguidance's dialect) or a GBNF one (with ::=).",
                      f"{_STRUCTURED}::test_openai_and_vllm_spellings_constrain_both_routes"),
        "json_object": _h("true: any JSON object.",
                          f"{_STRUCTURED}::test_json_object_is_any_object_even_against_a_bias", _ONE_AT_MOST),
    },
    "TGIGrammar": {
        "type": _h("json (or json_object), json_schema or regex.",
                   f"{_STRUCTURED}::test_tgi_grammar_constrains_generate"),
        "value": _h("The schema (object or JSON text), {name, schema}, or the regular expression.",
                    f"{_STRUCTURED}::test_tgi_grammar_constrains_generate"),
    },
})


def render_markdown() -> str:
    """The table as docs/API.md holds it: one section per request model, a row per field."""
    lines: list[str] = []
    for model, rows in PARAMETERS.items():
        lines += [f"### {model}: {ROUTES.get(model, '')}".rstrip(": "), "",
                  "| field | status | what the server does | shown by |", "|---|---|---|---|"]
        for name, row in rows.items():
            tests = "<br>".join(f"`{t}`" for t in row.shown_by)
            lines.append(f"| `{name}` | {row.status} | {row.meaning} | {tests} |")
        lines.append("")
    return "\n".join(lines)
