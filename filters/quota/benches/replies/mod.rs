//! The backend's streamed answer the benches that measure quota time: this
//! crate's `quota_stage` and the chain benches (`tests/benches/hot_path.rs`
//! includes this file), so both time the same stream.

/// An OpenAI stream of `tokens` deltas, the usage chunk and `[DONE]`.
pub fn openai_sse(tokens: usize) -> Vec<String> {
    let mut sse: Vec<String> = (0..tokens)
        .map(|i| format!("data: {{\"id\":\"c1\",\"model\":\"gpt-test\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i} \"}}}}],\"usage\":null}}\n\n"))
        .collect();
    sse.push(format!("data: {{\"id\":\"c1\",\"model\":\"gpt-test\",\"choices\":[],\"usage\":{{\"prompt_tokens\":11,\"completion_tokens\":{tokens},\"total_tokens\":{}}}}}\n\n", tokens + 11));
    sse.push("data: [DONE]\n\n".to_string());
    sse
}
