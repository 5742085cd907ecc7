//! A completion's text, built once, token by token: each token is decoded against a short window
//! of the tokens before it (tokenizers' `DecodeStream` algorithm), so a long completion costs
//! O(tokens), not the O(tokens²) of decoding the whole completion again after every token. Stop
//! strings are looked for once, in the new text only, and the text handed out to streams holds
//! back what may still turn out to be the start of a stop string.

use tokenizers::Tokenizer;

/// One completion's text so far.
#[derive(Debug, Default)]
pub(crate) struct TextStream {
    /// tokenizers' `DecodeStream` state, owned here so that a sequence can keep it: the ids
    /// decoded together, the text of the first `prefix_index` of them, and that count.
    window: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    /// The completion's text: complete characters only, cut before a matched stop string.
    text: String,
    /// How many bytes of `text` have been handed out by [`TextStream::take_delta`].
    released: usize,
    stop: Vec<String>,
}

impl TextStream {
    pub(crate) fn new(stop: &[String]) -> Self {
        TextStream {
            stop: stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..TextStream::default()
        }
    }

    /// Adds the next generated token (never a stop or end-of-sequence token: those are not
    /// text). Returns true when a stop string now appears; the text is then cut before it.
    pub(crate) fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> bool {
        let stepped = tokenizers::tokenizer::step_decode_stream(
            tokenizer,
            vec![id],
            true,
            &mut self.window,
            &mut self.prefix,
            &mut self.prefix_index,
        );
        let new = match stepped {
            Ok(new) => new.unwrap_or_default(),
            // The window's decoding no longer extends its prefix (a decoder that rewrites
            // earlier text): start a fresh window at this token rather than fail the request.
            Err(_) => {
                self.window.clear();
                self.prefix.clear();
                self.prefix_index = 0;
                tokenizer.decode(&[id], true).unwrap_or_default()
            }
        };
        self.append(&new)
    }

    /// Appends decoded text and settles stop strings in the part of the text they can now end in.
    fn append(&mut self, new: &str) -> bool {
        if new.is_empty() {
            return false;
        }
        let longest_stop = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = self
            .text
            .len()
            .saturating_sub(longest_stop.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.text.push_str(new);
        let tail = &self.text[from..];
        match self.stop.iter().filter_map(|s| tail.find(s.as_str())).min() {
            Some(at) => {
                self.text.truncate(from + at);
                true
            }
            None => false,
        }
    }

    /// At the end of a completion cut mid-character (by `max_tokens`), the ids still waiting
    /// for the rest of their character, decoded as they are (with U+FFFD), as a full decode would.
    pub(crate) fn flush(&mut self, tokenizer: &Tokenizer) {
        if let Ok(all) = tokenizer.decode(&self.window, true) {
            if let Some(rest) = all.strip_prefix(self.prefix.as_str()) {
                if rest.ends_with('\u{FFFD}') {
                    let rest = rest.to_string();
                    self.append(&rest);
                }
            }
        }
    }

    /// The text not handed out yet that can no longer change; all of it once `finished`.
    /// Before that, a tail that may be the start of a stop string is held back.
    pub(crate) fn take_delta(&mut self, finished: bool) -> String {
        let held = if finished {
            0
        } else {
            self.stop
                .iter()
                .flat_map(|s| {
                    (1..s.len())
                        .filter(|&k| s.is_char_boundary(k))
                        .map(move |k| &s[..k])
                })
                .filter(|prefix| self.text.ends_with(prefix))
                .map(str::len)
                .max()
                .unwrap_or(0)
        };
        let end = (self.text.len() - held).max(self.released);
        let delta = self.text[self.released..end].to_string();
        self.released = end;
        delta
    }

    pub(crate) fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream fed ready-made text pieces (what the tokenizer would decode).
    fn fed(stop: &[&str], pieces: &[&str]) -> (TextStream, Vec<String>, Option<usize>) {
        let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
        let mut stream = TextStream::new(&stop);
        let mut deltas = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let stopped = stream.append(piece);
            deltas.push(stream.take_delta(stopped || i + 1 == pieces.len()));
            if stopped {
                return (stream, deltas, Some(i));
            }
        }
        (stream, deltas, None)
    }

    #[test]
    fn a_stop_string_split_across_tokens_is_cut_and_never_sent() {
        let (stream, deltas, stopped_at) = fed(&["</answer>"], &["42", "</", "ans", "wer>", "!"]);
        assert_eq!(stopped_at, Some(3));
        assert_eq!(stream.text(), "42");
        assert_eq!(deltas, ["42", "", "", ""]);
    }

    #[test]
    fn held_text_is_released_once_it_cannot_start_a_stop_string() {
        let (stream, deltas, stopped_at) = fed(&["STOP"], &["a S", "T", "x", "y"]);
        assert_eq!(stopped_at, None);
        assert_eq!(stream.text(), "a STxy");
        assert_eq!(deltas, ["a ", "", "STx", "y"]);
        assert_eq!(deltas.concat(), stream.text());
    }

    #[test]
    fn a_stop_string_inside_one_piece_and_multibyte_text() {
        let (stream, deltas, _) = fed(&["é!"], &["café", "!done"]);
        assert_eq!(stream.text(), "caf");
        assert_eq!(deltas.concat(), "caf");
    }
}
