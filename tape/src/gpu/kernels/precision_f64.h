#define real double
#define SFX(name) name##_f64
#define EXP exp
#define LOG log
#define TANH tanh
#define ERF erf
#define SQRT sqrt
#define MUL_RN MUL_RN_F64
