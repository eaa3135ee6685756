#undef real
#undef SFX
#undef EXP
#undef LOG
#undef TANH
#undef ERF
#undef SQRT
#undef MUL_RN
