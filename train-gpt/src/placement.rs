//! Where a process sits on its machine, as the launcher that started it says: its rank
//! among the processes on this node and how many there are. Processes take the node's
//! GPUs in turn by local rank and share its cores. OpenMPI's `mpirun`, MPICH's Hydra,
//! Slurm's `srun` and torchrun each say it in their own variables.

/// This process's rank among the `size` processes on its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub local_rank: usize,
    pub local_size: usize,
}

impl Placement {
    /// The GPU this process takes of `devices` (the node's, from `--device`'s on): the
    /// local rank's in turn.
    pub fn device_of(&self, devices: &std::ops::Range<usize>) -> usize {
        devices.start + self.local_rank % devices.len().max(1)
    }
}

/// The placement the launcher's variables give (`var` reads one), first found of
/// OpenMPI, MPICH, torchrun and Slurm; `None` when none is set, or when one is set but
/// inconsistent (a rank outside its size).
pub fn from_launcher(var: impl Fn(&str) -> Option<String>) -> Option<Placement> {
    let number = |name: &str| var(name)?.trim().parse::<usize>().ok();
    let pairs = [
        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ];
    let found = pairs
        .iter()
        .find_map(|(rank, size)| Some((number(rank)?, number(size)?)))
        .or_else(|| Some((number("SLURM_LOCALID")?, slurm_tasks_here(&var)?)));
    let (local_rank, local_size) = found?;
    (local_rank < local_size).then_some(Placement {
        local_rank,
        local_size,
    })
}

/// The placement from this process's environment.
pub fn from_environment() -> Option<Placement> {
    from_launcher(|name| std::env::var(name).ok())
}

/// Slurm's tasks on this node: this node's entry of the step's list
/// (`SLURM_STEP_TASKS_PER_NODE` at `SLURM_STEP_NODEID`), else of the job's
/// (`SLURM_TASKS_PER_NODE` at `SLURM_NODEID`), else `SLURM_NTASKS_PER_NODE` (the job's
/// request). The lists compress runs of equal counts: `4(x2),3` is 4 on nodes 0 and 1 and
/// 3 on node 2.
fn slurm_tasks_here(var: &impl Fn(&str) -> Option<String>) -> Option<usize> {
    let entry = |list: &str, node: &str| {
        let node: usize = var(node)?.trim().parse().ok()?;
        nth_count(&var(list)?, node)
    };
    entry("SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODEID")
        .or_else(|| entry("SLURM_TASKS_PER_NODE", "SLURM_NODEID"))
        .or_else(|| var("SLURM_NTASKS_PER_NODE")?.trim().parse().ok())
}

/// Entry `node` of a Slurm count list such as `4(x2),3`.
fn nth_count(list: &str, node: usize) -> Option<usize> {
    let mut first_node = 0;
    for group in list.split(',') {
        let (count, repeat) = match group.trim().split_once("(x") {
            Some((count, rest)) => (count, rest.strip_suffix(')')?.parse().ok()?),
            None => (group.trim(), 1usize),
        };
        if node < first_node + repeat {
            return count.parse().ok();
        }
        first_node += repeat;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn placement(vars: &[(&str, &str)]) -> Option<Placement> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_launcher(|name| vars.get(name).cloned())
    }

    fn at(local_rank: usize, local_size: usize) -> Option<Placement> {
        Some(Placement {
            local_rank,
            local_size,
        })
    }

    #[test]
    fn processes_take_the_nodes_gpus_in_turn_from_the_first_given() {
        let devices = 2..8; // --device cuda:2 on a node of 8 GPUs
        let device = |local_rank| {
            Placement {
                local_rank,
                local_size: 12,
            }
            .device_of(&devices)
        };
        assert_eq!([0, 1, 5, 6, 11].map(device), [2, 3, 7, 2, 7]);
    }

    #[test]
    fn each_launcher_is_read() {
        let openmpi = [
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
        ];
        assert_eq!(placement(&openmpi), at(3, 8));
        let mpich = [("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "2")];
        assert_eq!(placement(&mpich), at(1, 2));
        let torchrun = [("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "4")];
        assert_eq!(placement(&torchrun), at(0, 4));
        let slurm_fixed = [("SLURM_LOCALID", "2"), ("SLURM_NTASKS_PER_NODE", "4")];
        assert_eq!(placement(&slurm_fixed), at(2, 4));
        assert_eq!(placement(&[]), None);
    }

    #[test]
    fn slurm_counts_come_from_this_nodes_entry() {
        let on_node = |node: &str, local: &str| {
            placement(&[
                ("SLURM_LOCALID", local),
                ("SLURM_NODEID", node),
                ("SLURM_TASKS_PER_NODE", "4(x2),3"),
            ])
        };
        assert_eq!(on_node("0", "3"), at(3, 4));
        assert_eq!(on_node("1", "0"), at(0, 4));
        assert_eq!(on_node("2", "2"), at(2, 3));
        // Past the listed nodes, or a rank outside its node's count: unknown.
        assert_eq!(on_node("3", "0"), None);
        assert_eq!(on_node("2", "3"), None);
        // A step's own list (it may use fewer tasks than the job) comes first.
        let step = [
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODEID", "0"),
            ("SLURM_STEP_TASKS_PER_NODE", "2"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "8(x2)"),
        ];
        assert_eq!(placement(&step), at(1, 2));
    }

    #[test]
    fn openmpi_comes_first_and_nonsense_is_ignored() {
        let both = [
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("LOCAL_RANK", "5"),
            ("LOCAL_WORLD_SIZE", "8"),
        ];
        assert_eq!(placement(&both), at(1, 2));
        let garbled = [("LOCAL_RANK", "x"), ("LOCAL_WORLD_SIZE", "8")];
        assert_eq!(placement(&garbled), None);
        let malformed = [
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "4(x2"),
        ];
        assert_eq!(placement(&malformed), None);
    }
}
