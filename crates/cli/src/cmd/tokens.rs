//! `lastcall tokens hash`: the SHA-256 of a token for `serve --tokens-file`
//! (`lastcall_http::tokens`). The token comes from stdin, never from a flag.

use crate::cli::TokensCommand;
use anyhow::{Context, Result, bail};
use std::io::Read;
use std::process::ExitCode;

pub fn run(c: TokensCommand) -> Result<ExitCode> {
    match c {
        TokensCommand::Hash { tenant, bare } => {
            let mut token = String::new();
            std::io::stdin()
                .read_to_string(&mut token)
                .context("reading the token from stdin")?;
            print!("{}", entry(&token, &tenant, bare)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The hash (with `bare`) or a `[[token]]` entry for `token`.
fn entry(token: &str, tenant: &lastcall_core::Tenant, bare: bool) -> Result<String> {
    let t = token.trim();
    if t.is_empty() {
        bail!("no token on stdin: pipe it in, e.g. `lastcall tokens hash < team-a.token`");
    }
    if t.len() < 16 {
        bail!(
            "the token is {} characters long; use at least 16 (e.g. `openssl rand -hex 24`)",
            t.len()
        );
    }
    let hash = lastcall_http::tokens::hash_token(t);
    Ok(if bare {
        format!("{hash}\n")
    } else {
        format!(
            "[[token]]\nsha256 = \"{hash}\"\ntenant = \"{tenant}\"\n# weight = 1\n# jobs_per_second = 10\n# tokens_per_minute = 100000\n# kinds = [\"chat\"]\n# max_priority = \"standard\"\n# max_waiting = 1024\n# max_streams = 256\n# max_requests = 2048\n"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_an_entry_the_tokens_file_accepts() {
        let tenant = lastcall_core::Tenant::parse("team-a").unwrap();
        let text = entry("  0123456789abcdef-secret\n", &tenant, false).unwrap();
        let file = lastcall_http::tokens::TokensFile::parse(&text).unwrap();
        let e = file.lookup(b"0123456789abcdef-secret").unwrap();
        assert_eq!(e.tenant.as_str(), "team-a");
        assert!(!text.contains("secret"), "{text}");
        let bare = entry("0123456789abcdef-secret", &tenant, true).unwrap();
        assert_eq!(bare.trim().len(), 64);
        assert!(text.contains(bare.trim()));
        let e = entry("short", &tenant, true).unwrap_err().to_string();
        assert!(e.contains("at least 16"), "{e}");
        let e = entry(" \n", &tenant, true).unwrap_err().to_string();
        assert!(e.contains("stdin"), "{e}");
    }
}
