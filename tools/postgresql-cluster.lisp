;;;; A throwaway PostgreSQL cluster for the tests and the benchmark: made by
;;;; Debian's initdb in a temporary folder, listening only on a Unix socket
;;;; in that folder, run by the postgres user when this process is root
;;;; (PostgreSQL refuses to run as root), and removed afterwards.  Only the
;;;; processes of the cluster made here are ever stopped or signalled.

(defpackage #:postgresql-cluster
  (:use #:cl)
  (:export #:postgresql-cluster #:start-postgresql-cluster #:remove-postgresql-cluster
           #:stop-postgresql-server #:start-postgresql-server #:pause-postgresql-server
           #:resume-postgresql-server #:postgresql-cluster-socket-directory
           #:postgresql-cluster-environment #:postgresql-cluster-available-p))

(in-package #:postgresql-cluster)

(defstruct (postgresql-cluster (:constructor make-postgresql-cluster (directory bin)))
  "A cluster made by START-POSTGRESQL-CLUSTER."
  ;; The temporary folder: the data in data/, the socket and the log beside it.
  (directory nil :read-only t)
  ;; The folder of Debian's PostgreSQL programs.
  (bin nil :read-only t))

(defun postgresql-bin-directory ()
  "The bin folder of the newest PostgreSQL Debian installed, or NIL."
  (let ((folders (directory #p"/usr/lib/postgresql/*/bin/initdb")))
    (when folders
      (uiop:pathname-directory-pathname
       (first (sort folders #'> :key (lambda (path)
                                       (or (parse-integer (car (last (pathname-directory path) 2))
                                                          :junk-allowed t)
                                           0))))))))

(defun postgresql-cluster-available-p ()
  "True when Debian's PostgreSQL server programs are installed."
  (not (null (postgresql-bin-directory))))

(defun root-p ()
  (zerop (sb-posix:getuid)))

(defun run-as-server-user (cluster program &rest arguments)
  "Run PROGRAM of CLUSTER's bin folder with ARGUMENTS, as the postgres user
when this process is root; its output, or an error with it when it fails."
  (let ((command (cons (namestring (merge-pathnames program (postgresql-cluster-bin cluster))) arguments)))
    (uiop:run-program (if (root-p) (list* "runuser" "-u" "postgres" "--" command) command)
                      :output :string :error-output :output)))

(defun postgresql-cluster-socket-directory (cluster)
  "The folder holding CLUSTER's Unix socket: its PGHOST."
  (namestring (postgresql-cluster-directory cluster)))

(defun data-directory (cluster)
  (namestring (merge-pathnames "data/" (postgresql-cluster-directory cluster))))

(defun postgresql-cluster-environment (cluster)
  "The PG* environment entries that name CLUSTER's postgres database."
  (list (format nil "PGHOST=~A" (postgresql-cluster-socket-directory cluster))
        "PGPORT=5432" "PGDATABASE=postgres" "PGUSER=postgres"))

(defun start-postgresql-server (cluster)
  "Start CLUSTER's server and wait until it takes connections."
  (run-as-server-user cluster "pg_ctl" "-D" (data-directory cluster) "-w" "-t" "60"
                      "-l" (namestring (merge-pathnames "server.log" (postgresql-cluster-directory cluster)))
                      "-o" (format nil "-c listen_addresses='' -c unix_socket_directories=~A ~
                                        -c fsync=off -c synchronous_commit=off -c max_connections=200"
                                   (postgresql-cluster-socket-directory cluster))
                      "start"))

(defun stop-postgresql-server (cluster &key (mode "fast"))
  "Stop CLUSTER's server (MODE: smart, fast or immediate) and wait until it has."
  (run-as-server-user cluster "pg_ctl" "-D" (data-directory cluster) "-w" "-m" mode "stop"))

(defun start-postgresql-cluster ()
  "A new cluster in a new temporary folder, its server started."
  (let* ((directory (uiop:ensure-directory-pathname
                     (format nil "/tmp/postgresql-cluster-~D-~36R/" (sb-posix:getpid) (random (expt 36 6)
                                                                                               (make-random-state t)))))
         (cluster (make-postgresql-cluster directory (postgresql-bin-directory))))
    (ensure-directories-exist directory)
    (when (root-p)
      (uiop:run-program (list "chown" "postgres" (namestring directory))))
    (run-as-server-user cluster "initdb" "-D" (data-directory cluster) "--auth=trust" "-U" "postgres"
                        "-E" "UTF8" "--no-sync")
    (start-postgresql-server cluster)
    cluster))

(defun server-process-ids (cluster)
  "The ids of CLUSTER's postmaster and of its children."
  (let* ((pid-file (merge-pathnames "postmaster.pid" (data-directory cluster)))
         (postmaster (with-open-file (in pid-file :if-does-not-exist nil)
                       (and in (parse-integer (read-line in) :junk-allowed t)))))
    (when postmaster
      (cons postmaster
            (loop for process in (directory #p"/proc/*/")
                  for fields = (and (every #'digit-char-p (car (last (pathname-directory process))))
                                    (ignore-errors (uiop:split-string (uiop:read-file-line
                                                                       (merge-pathnames "stat" process))
                                                                      :separator " ")))
                  ;; pid (comm) state ppid: the command holds no space for PostgreSQL's processes.
                  when (and fields (equal (fourth fields) (princ-to-string postmaster)))
                    collect (parse-integer (first fields)))))))

(defun pause-postgresql-server (cluster)
  "Stop CLUSTER's processes with SIGSTOP: the server is there, and answers nothing."
  (dolist (pid (server-process-ids cluster))
    (sb-posix:kill pid sb-posix:sigstop)))

(defun resume-postgresql-server (cluster)
  "Let CLUSTER's processes go on after PAUSE-POSTGRESQL-SERVER."
  (dolist (pid (server-process-ids cluster))
    (sb-posix:kill pid sb-posix:sigcont)))

(defun remove-postgresql-cluster (cluster)
  "Stop CLUSTER's server at once and delete its folder."
  (ignore-errors (resume-postgresql-server cluster))
  (ignore-errors (stop-postgresql-server cluster :mode "immediate"))
  (uiop:delete-directory-tree (postgresql-cluster-directory cluster) :validate t :if-does-not-exist :ignore))
