pub mod chat_template;
pub mod tool_calls;
