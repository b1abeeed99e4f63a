package dialect

// What the external tests of this package need of its unexported names.
var (
	MySQL         = mysqlDialect{}
	DuplicateKey  = duplicateKey
	ErrOverPacket = errOverPacket
)
