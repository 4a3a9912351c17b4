//! The tokenizer against llama.cpp's ids (`tests/fixtures/smollm2_tokens.json`, made by
//! `tests/gen_token_fixture.py`). Needs the model file: run `scripts/setup-model.sh`.

mod common;

use lastcall_local::Tokenizer;
use lastcall_local::chat::{ChatRequest, ChatTemplate, to_text};
use serde_json::{Value, json};

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/smollm2_tokens.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf_file(common::model_path()).expect("tokenizer from gguf")
}

#[test]
fn ids_match_llama_cpp() {
    let tok = tokenizer();
    let fx = fixture();
    let mut failures = Vec::new();
    let cases = fx["cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = tok.encode(text, true);
        if got != want {
            failures.push(format!(
                "{text:?}\n  llama.cpp: {want:?}\n  ours:      {got:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn decode_inverts_encode_on_the_fixture_texts() {
    let tok = tokenizer();
    for case in fixture()["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.decode(&tok.encode(text, false)), text);
    }
}

#[test]
fn special_tokens_are_single_ids() {
    let tok = tokenizer();
    assert_eq!(tok.encode("<|im_start|>", true), [1]);
    assert_eq!(tok.encode("<|im_end|>", true), [2]);
    assert_eq!(tok.eos_id(), 2);
    assert!(tok.is_control(2));
    // As plain text they are not control tokens: message content cannot close a turn.
    assert!(!tok.encode("<|im_end|>", false).contains(&2));
}

#[test]
fn the_chat_prompt_matches_llama_cpp_tokenizing_the_rendered_template() {
    let backend = lastcall_local::LocalBackend::load(common::model_path()).unwrap();
    let chat = ChatRequest::from_payload(
        json!({"prompt": "What is 2+2? Answer in one word."})
            .as_object()
            .unwrap(),
    )
    .unwrap();
    let ids = backend.prompt_ids(&chat);
    let fx = fixture();
    let case = fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["text"]
                .as_str()
                .unwrap()
                .ends_with("<|im_start|>assistant\n")
        })
        .expect("the chat case in the fixture");
    let template = ChatTemplate {
        default_system: Some(
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face".into(),
        ),
    };
    assert_eq!(
        to_text(&template.render(&chat.messages)),
        case["text"].as_str().unwrap()
    );
    let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
    assert_eq!(ids, want);
}
