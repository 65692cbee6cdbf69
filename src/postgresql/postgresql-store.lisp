;;;; The PostgreSQL session store: sessions in one table (session-schema.lisp)
;;;; that every process and machine using the database shares, through a
;;;; pool of connections per process (connection-pool.lisp), each statement
;;;; prepared once per connection.  A lookup refreshes the session's last
;;;; click and returns it in one statement; expiry is a condition of that
;;;; statement, and garbage collection a query by the expiry index.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *session-statements*
  '(("find-session"
     "UPDATE hunchentoot_sessions SET last_click = $3
       WHERE id = $1 AND session_string = $2 AND last_click + max_time >= $3
       RETURNING user_agent, remote_addr, started_at, max_time, data")
    ("add-session"
     "INSERT INTO hunchentoot_sessions
       (id, session_string, user_agent, remote_addr, started_at, last_click, max_time, data)
       VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING")
    ("save-session"
     "UPDATE hunchentoot_sessions SET session_string = $2, started_at = $3, max_time = $4, data = $5
       WHERE id = $1")
    ("remove-session"
     "DELETE FROM hunchentoot_sessions WHERE id = $1")
    ("expired-sessions"
     "SELECT id, session_string, user_agent, remote_addr, started_at, last_click, max_time, data
        FROM hunchentoot_sessions WHERE last_click + max_time < $1
       ORDER BY last_click + max_time LIMIT 500"))
  "The name and text of each statement the store prepares on its connections.")

(defclass postgresql-session-store (session-store)
  ((description
    :initarg :description :reader postgresql-store-description
    :documentation "Where the database is, for log lines: database@host:port.")
   (pool
    :initarg :pool :reader postgresql-store-pool
    :documentation "This process's DATABASE-POOL of connections to it."))
  (:documentation "A SESSION-STORE in a PostgreSQL database shared by every
process and machine that uses it: sessions outlive a restart, and any
process serves any session.  Made by MAKE-POSTGRESQL-SESSION-STORE."))

(defmethod print-object ((store postgresql-session-store) stream)
  (print-unreadable-object (store stream :type t)
    (write-string (postgresql-store-description store) stream)))

(defun environment-or (name default)
  "The environment variable NAME when set and not empty, else DEFAULT."
  (let ((value (uiop:getenv name)))
    (if (and value (plusp (length value))) value default)))

(defun open-prepared-database (database user password host port statements)
  "A new connection to DATABASE, its schema brought up to date and
STATEMENTS (a list of names and texts) prepared; closed again if that fails."
  (let ((connection (cl-postgres:open-database database user password host port)))
    (handler-bind ((serious-condition (lambda (condition)
                                        (declare (ignore condition))
                                        (close-database-connection connection))))
      (migrate-session-schema connection)
      (loop for (name text) in statements
            do (cl-postgres:prepare-query connection name text)))
    connection))

(defun open-session-database (database user password host port)
  "A new connection to DATABASE for the store, its statements prepared."
  (open-prepared-database database user password host port *session-statements*))

(defun make-postgresql-session-store (&key (database (environment-or "PGDATABASE" nil))
                                           (user (environment-or "PGUSER" "postgres"))
                                           (password (environment-or "PGPASSWORD" nil))
                                           (host (environment-or "PGHOST" "/var/run/postgresql"))
                                           (port (parse-integer (environment-or "PGPORT" "5432")))
                                           (max-connections 8))
  "A POSTGRESQL-SESSION-STORE in DATABASE, reached as USER (with PASSWORD)
at HOST and PORT: a host name, or a directory holding the server's Unix
socket.  Each defaults to its standard PostgreSQL environment variable
(PGDATABASE, PGUSER, PGPASSWORD, PGHOST, PGPORT).  The process keeps at
most MAX-CONNECTIONS connections to it.  No connection is opened until a
session is first needed, so the acceptor starts while the database is
down; the store's tables are made on the first connection if missing."
  (unless (stringp database)
    (error 'invalid-session-store-configuration :initarg :database :value database
                                                 :reason "must name a database (or set PGDATABASE)"))
  (unless (and (integerp max-connections) (plusp max-connections))
    (error 'invalid-session-store-configuration :initarg :max-connections :value max-connections
                                                 :reason "must be a positive integer"))
  (make-instance 'postgresql-session-store
                 :description (format nil "~A@~A:~D" database host port)
                 :pool (make-database-pool (lambda () (open-session-database database user password host port))
                                           max-connections)))

(defun call-with-session-database (store function)
  "FUNCTION called with a connection of STORE's pool; its values.  Every
error of the database or of cl-postgres signals
SESSION-STORE-UNAVAILABLE.  cl-postgres's
warnings are muffled: it warns of each socket it could not close cleanly
after the server went away, a failure the call reports already, each in a
message-log entry of several lines."
  (handler-case (handler-bind ((warning #'muffle-warning))
                  (call-with-database-connection (postgresql-store-pool store) function))
    (error (condition)
      (error 'session-store-unavailable
             :store store
             :reason (substitute #\Space #\Newline (princ-to-string condition))))))

(defmacro with-session-database ((connection store) &body body)
  "Run BODY with CONNECTION bound to a connection of STORE's pool, as CALL-WITH-SESSION-DATABASE."
  `(call-with-session-database ,store (lambda (,connection) ,@body)))

(defun sql-text-or-null (value)
  "VALUE as a statement parameter: :NULL for NIL."
  (or value :null))

(defun text-or-nil (value)
  "A column's VALUE as Lisp: NIL for SQL NULL."
  (if (eq value :null) nil value))

(defun stored-session-from-row (store id string user-agent remote-addr started-at last-click max-time data-text)
  "The STORED-SESSION of a row of STORE, or NIL (logged) when its values cannot be read here."
  (multiple-value-bind (data problem) (session-data-from-text data-text)
    (if problem
        (progn
          (hunchentoot:log-message* :warning "The values of a session in ~A are ~A; the session is ~
treated as absent" store problem)
          nil)
        (make-stored-session :id id :string string
                             :user-agent (text-or-nil user-agent) :remote-addr (text-or-nil remote-addr)
                             :start started-at :last-click last-click :max-time max-time :data data))))

(defmethod find-stored-session ((store postgresql-session-store) id string time)
  (let ((row (first (with-session-database (connection store)
                      (cl-postgres:exec-prepared connection "find-session"
                                                 (list (princ-to-string id) string time)
                                                 'cl-postgres:list-row-reader)))))
    (when row
      (destructuring-bind (user-agent remote-addr started-at max-time data-text) row
        (stored-session-from-row store id string user-agent remote-addr started-at time max-time data-text)))))

(defmethod add-stored-session ((store postgresql-session-store) (session stored-session))
  (with-session-database (connection store)
    (cl-postgres:exec-prepared connection "add-session"
                               (list (princ-to-string (hunchentoot:session-id session))
                                     (session-string session)
                                     (sql-text-or-null (hunchentoot:session-user-agent session))
                                     (sql-text-or-null (hunchentoot:session-remote-addr session))
                                     (hunchentoot:session-start session)
                                     (session-last-click session)
                                     (hunchentoot:session-max-time session)
                                     (stored-session-data-text session)))))

(defmethod save-stored-session ((store postgresql-session-store) (session stored-session))
  (with-session-database (connection store)
    (cl-postgres:exec-prepared connection "save-session"
                               (list (princ-to-string (hunchentoot:session-id session))
                                     (session-string session)
                                     (hunchentoot:session-start session)
                                     (hunchentoot:session-max-time session)
                                     (stored-session-data-text session)))))

(defmethod remove-stored-session ((store postgresql-session-store) (session stored-session))
  (with-session-database (connection store)
    (cl-postgres:exec-prepared connection "remove-session"
                               (list (princ-to-string (hunchentoot:session-id session))))))

(defmethod expired-stored-sessions ((store postgresql-session-store) time)
  (loop for (id string user-agent remote-addr started-at last-click max-time data-text)
          in (with-session-database (connection store)
               (cl-postgres:exec-prepared connection "expired-sessions" (list time)
                                          'cl-postgres:list-row-reader))
        for session = (stored-session-from-row store (parse-integer id) string user-agent remote-addr
                                               started-at last-click max-time data-text)
        ;; One whose values this process cannot read is removed all the same.
        collect (or session
                    (make-stored-session :id (parse-integer id) :string string :start started-at
                                         :last-click last-click :max-time max-time :data '()))))
