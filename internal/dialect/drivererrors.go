package dialect

import (
	"errors"
	"reflect"
)

// The drivers' errors are recognised by their shape, not their type, so
// that this package imports no database driver: a program links only the
// drivers it opens itself (a PostgreSQL-only program builds without cgo,
// a MySQL-only one without pgx). TestRootImportsNoDriver holds to that.

// sqlState returns the SQLSTATE of the first error in err's tree that has
// one: pgx's *pgconn.PgError says it through a SQLState method.
func sqlState(err error) (string, bool) {
	var se interface{ SQLState() string }
	if errors.As(err, &se) {
		return se.SQLState(), true
	}
	return "", false
}

// mysqlError returns the error number and message of the first MySQL
// server error in err's tree: go-sql-driver/mysql's *MySQLError, a struct
// with a Number and a Message.
func mysqlError(err error) (number uint64, message string, ok bool) {
	found := walkErrors(err, func(e error) bool {
		v, isStruct := structOf(e)
		if !isStruct || v.Type().Name() != "MySQLError" {
			return false
		}
		n, msg := field(v, "Number"), field(v, "Message")
		if msg.Kind() != reflect.String {
			return false
		}
		switch n.Kind() {
		case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			number, message = n.Uint(), msg.String()
			return true
		}
		return false
	})
	return number, message, found
}

// sqliteCode returns the extended result code of the first SQLite error in
// err's tree: the pure-Go drivers (modernc.org/sqlite, and its fork
// github.com/glebarez/go-sqlite under github.com/glebarez/sqlite) say it
// through a Code method; mattn/go-sqlite3's sqlite3.Error is a struct with
// an ExtendedCode.
func sqliteCode(err error) (int64, bool) {
	var code int64
	found := walkErrors(err, func(e error) bool {
		if c, ok := e.(interface{ Code() int }); ok {
			code = int64(c.Code())
			return true
		}
		v, isStruct := structOf(e)
		if !isStruct || v.Type().Name() != "Error" {
			return false
		}
		f := field(v, "ExtendedCode")
		switch f.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			code = f.Int()
			return true
		}
		return false
	})
	return code, found
}

// walkErrors calls match on err and on every error it wraps, depth first
// through Unwrap() error and Unwrap() []error (errors.Join, fmt.Errorf
// with several %w), as errors.As does, until match returns true.
func walkErrors(err error, match func(error) bool) bool {
	for err != nil {
		if match(err) {
			return true
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if walkErrors(e, match) {
					return true
				}
			}
			return false
		default:
			return false
		}
	}
	return false
}

// structOf returns the struct that e is, or points to.
func structOf(e error) (reflect.Value, bool) {
	v := reflect.ValueOf(e)
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return reflect.Value{}, false
		}
		v = v.Elem()
	}
	return v, v.Kind() == reflect.Struct
}

// field returns v's field of that name, or the zero Value (whose Kind is
// Invalid) where v has none or reaching it would go through a nil
// embedded pointer.
func field(v reflect.Value, name string) reflect.Value {
	sf, ok := v.Type().FieldByName(name)
	if !ok {
		return reflect.Value{}
	}
	f, err := v.FieldByIndexErr(sf.Index)
	if err != nil {
		return reflect.Value{}
	}
	return f
}
