//! The finetune example's command line: every flag described, and the
//! training data's format in the long help.

#[allow(dead_code)]
#[path = "../examples/finetune.rs"]
mod finetune_example;

use clap::CommandFactory;

#[test]
fn every_flag_has_help() {
    let cmd = finetune_example::Args::command();
    for arg in cmd.get_arguments() {
        assert!(arg.get_help().is_some(), "--{} has no help", arg.get_id());
    }
}

#[test]
fn long_help_describes_the_data() {
    let about = finetune_example::Args::command().get_long_about().map(|s| s.to_string()).unwrap_or_default();
    for field in ["\"query\"", "\"positive\"", "\"negative\"", "negative_1", "query_id", "document_ids", "scores"] {
        assert!(about.contains(field), "finetune --help does not describe `{field}`");
    }
}
