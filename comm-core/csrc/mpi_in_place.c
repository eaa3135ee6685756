/* MPI_IN_PLACE is a macro whose value differs between MPI implementations (OpenMPI
 * ((void *) 1), MPICH ((void *) -1)); rsmpi does not export it, so this shim reads it
 * from the system's own mpi.h. */
#include <mpi.h>

void *ferrotron_mpi_in_place(void) { return MPI_IN_PLACE; }
