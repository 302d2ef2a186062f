//! The README's C examples compile against the generated header, as a C program would
//! build them; its layout table names every source file of `src/`, `ffi/src/`, `cpp/src/`
//! and `rpc/src/` (by path, or in its directory's row) and no file that does not exist. (Its
//! Rust examples are doctests: `ReadmeExamples` in src/lib.rs; its Python examples are
//! compiled by python/tests/test_readme.py.)

use std::path::Path;
use std::process::Command;

/// The bodies of the README's code blocks fenced as ```` ```lang ````, with the line each
/// starts on.
fn blocks(readme: &str, lang: &str) -> Vec<(usize, String)> {
    let fence = format!("```{lang}");
    let mut out = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (n, line) in readme.lines().enumerate() {
        match &mut open {
            None if line.trim_end() == fence => open = Some((n + 2, String::new())),
            Some(_) if line.trim_end() == "```" => out.push(open.take().expect("open")),
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    assert!(open.is_none(), "a ```{lang} block of the README is not closed");
    out
}

#[test]
fn c_examples_compile() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let examples = blocks(&readme, "c");
    assert!(!examples.is_empty(), "the README has no C example (```c blocks) to compile");
    let dir = TempDir::new();
    let dir = &dir.0;
    // The C compiler cargo links with (cc, or $CC): every machine that runs this test has it.
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    for (line, body) in &examples {
        let src = dir.join(format!("readme_line{line}.c"));
        std::fs::write(&src, body).unwrap();
        let out = Command::new(&cc)
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-c", "-o"])
            .arg(src.with_extension("o"))
            .arg("-I")
            .arg(root.join("ffi/include"))
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
        assert!(
            out.status.success(),
            "the README's C example at line {line} does not compile:\n{}\n{body}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A scratch directory, removed when dropped (also when an assertion fails).
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("tensorwire-readme-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The README's layout table: (the paths a row is about, the backquoted names in its text).
fn layout_rows(readme: &str) -> Vec<(Vec<String>, Vec<String>)> {
    let table = &readme[readme.find("## Layout\n").expect("the README has a ## Layout section")..];
    let quoted = |cell: &str| cell.split('`').skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>();
    let rows: Vec<_> = table
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').collect();
            let paths = quoted(cells.get(1)?);
            (!paths.is_empty()).then(|| (paths, quoted(&cells[2..].join("|"))))
        })
        .collect();
    assert!(rows.len() > 10, "the layout table has only {} rows", rows.len());
    rows
}

/// Every file below `dir` (relative to `root`, with '/'), build outputs left out.
fn files_below(root: &Path, dir: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![root.join(dir)];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !matches!(name.as_str(), "target" | "build" | "__pycache__" | "corpus" | "regressions") {
                    todo.push(path);
                }
            } else {
                out.push(path.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out
}

const SOURCE_EXTENSIONS: [&str; 6] = [".rs", ".cpp", ".h", ".c", ".py", ".sh"];

#[test]
fn layout_table_names_every_source_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rows = layout_rows(&std::fs::read_to_string(root.join("README.md")).unwrap());
    let mut missing = Vec::new();
    for file in ["src", "ffi/src", "cpp/src", "rpc/src"].iter().flat_map(|d| files_below(root, d)) {
        if !SOURCE_EXTENSIONS.iter().any(|e| file.ends_with(e)) || file.ends_with("/mod.rs") {
            continue;
        }
        let base = file.rsplit('/').next().unwrap();
        let named = rows.iter().any(|(paths, text)| {
            paths.iter().any(|p| {
                *p == file
                    || (p.ends_with('/')
                        && file.starts_with(p.as_str())
                        && text.iter().any(|t| t == base || file.ends_with(&format!("/{t}"))))
            })
        });
        if !named {
            missing.push(file);
        }
    }
    missing.sort();
    assert!(missing.is_empty(), "the README's layout table does not name these files: {missing:?}");
}

#[test]
fn layout_table_names_only_files_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rows = layout_rows(&std::fs::read_to_string(root.join("README.md")).unwrap());
    let mut stale = Vec::new();
    for (paths, text) in &rows {
        let here: Vec<String> = paths.iter().filter(|p| p.ends_with('/')).flat_map(|d| files_below(root, d)).collect();
        for name in paths.iter().chain(text) {
            let is_file = SOURCE_EXTENSIONS.iter().any(|e| name.ends_with(e)) && !name.contains(['*', ' ']);
            let exists = root.join(name).is_file() || here.iter().any(|f| f.ends_with(&format!("/{name}")));
            if is_file && !exists {
                stale.push(name.clone());
            }
        }
    }
    assert!(stale.is_empty(), "the README's layout table names files that do not exist: {stale:?}");
}
