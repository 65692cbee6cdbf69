;;;; The peers the matrix races ours against, from their unchanged sources
;;;; in ../shared/vendor (VENDOR in the environment names another folder):
;;;; Woo and the recycling taskmaster this project started from.  Each is
;;;; loaded in an SBCL of its own, with an ASDF source registry of its
;;;; vendor folders ahead of Debian's (both need bordeaux-threads 0.9, whose
;;;; BT2 API Debian's 0.8.8 lacks) and a fasl cache of its own (the
;;;; original taskmaster's system has this project's name), and saved as a
;;;; core once per run; its server file in bench/peers/ serves GET /yo.
;;;; Peers are measured on the handler workloads only: serving files is not
;;;; Woo's business (Lack's is).

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *peers*
  '((:name "woo" :label "Woo, 2 workers" :peer "woo" :system "woo"
     :vendor-folders ("woo" "lev" "swap-bytes" "static-vectors" "fast-http" "quri" "idna" "fast-io"
                      "smart-buffer" "xsubseq" "proc-parse" "vom" "trivial-mimes" "clack"
                      "bordeaux-threads-0.9.4"))
    (:name "original" :label "original recycling taskmaster" :peer "original-recycling-taskmaster"
     :system "hunchentoot-recycling-taskmaster"
     :vendor-folders ("original-recycling-taskmaster" "bordeaux-threads-0.9.4")))
  "Each peer: its name and label as *SERVERS* has them, its server file in
bench/peers/, the system that file needs, and the vendor folders that hold
that system and the dependencies Debian lacks.")

(defun checkout-directory ()
  (asdf:system-source-directory "hunchentoot-recycling-taskmaster"))

(defun vendor-directory ()
  "The folder of the peers' sources: VENDOR, or ../shared/vendor beside the checkout."
  (let ((vendor (uiop:getenv "VENDOR")))
    (if (and vendor (plusp (length vendor)))
        (uiop:ensure-directory-pathname vendor)
        (merge-pathnames "../shared/vendor/" (checkout-directory)))))

(defun peer-vendor-folders (peer)
  (mapcar (lambda (folder) (merge-pathnames (format nil "~A/" folder) (vendor-directory)))
          (getf peer :vendor-folders)))

(defun available-peers ()
  "The peers whose vendor folders are all there."
  (remove-if-not (lambda (peer) (every #'probe-file (peer-vendor-folders peer))) *peers*))

(defun announce-missing-peers ()
  "Say which peers will not be measured, and why."
  (let ((missing (set-difference *peers* (available-peers))))
    (when missing
      (format t "~&Not measured: ~{~A~^, ~}: their sources are not in ~A (VENDOR names another ~
                 folder; bench/README.md says what it holds).~%"
              (mapcar (lambda (peer) (getf peer :label)) missing) (namestring (vendor-directory))))))

(defun peer-environment (peer)
  "The environment a PEER's SBCL runs in: its source registry and fasl cache."
  (append (list (format nil "CL_SOURCE_REGISTRY=~S"
                        `(:source-registry ,@(mapcar (lambda (folder) `(:tree ,(namestring folder)))
                                                     (peer-vendor-folders peer))
                                           :inherit-configuration))
                (format nil "XDG_CACHE_HOME=~A"
                        (namestring (uiop:xdg-cache-home "hunchentoot-recycling-taskmaster-peers"
                                                         (format nil "~A/" (getf peer :name))))))
          (remove-if (lambda (entry) (or (eql 0 (search "CL_SOURCE_REGISTRY=" entry))
                                         (eql 0 (search "XDG_CACHE_HOME=" entry))))
                     (sb-ext:posix-environ))))

(defun build-peer-core (peer directory)
  "PEER loaded and saved as a core in DIRECTORY: PEER with :CORE added, or
NIL (said) when it does not build; its log is DIRECTORY/<name>-build.log."
  (let ((core (format nil "~A~A.core" directory (getf peer :name)))
        (log (format nil "~A~A-build.log" directory (getf peer :name))))
    (format t "~&Building ~A from ~A~%" (getf peer :label) (namestring (vendor-directory)))
    (finish-output)
    (if (zerop (nth-value 2 (uiop:run-program
                             (list "sbcl" "--noinform" "--non-interactive" "--disable-debugger"
                                   "--eval" "(require :asdf)"
                                   "--eval" (format nil "(asdf:load-system ~S)" (getf peer :system))
                                   "--load" (namestring (merge-pathnames (format nil "bench/peers/~A.lisp" (getf peer :peer))
                                                                         (checkout-directory)))
                                   "--eval" (format nil "(sb-ext:save-lisp-and-die ~S)" core))
                             :environment (peer-environment peer)
                             :output log :error-output :output :if-output-exists :supersede
                             :ignore-error-status t)))
        (list* :core core peer)
        (progn (format t "~&~A did not build: see ~A~%" (getf peer :label) log)
               nil))))

(defun launch-peer (peer port delay-ms log-file &key page-file workers)
  "Start PEER (built by BUILD-PEER-CORE) on PORT on *SERVER-PROCESSORS*,
with WORKERS worker threads and the application cells' PAGE-FILE when
given (Woo's only: it serves with 2 workers unless told); its process-info."
  (uiop:launch-program (pinned-command
                        (list "sbcl" "--core" (getf peer :core) "--noinform" "--non-interactive" "--disable-debugger"
                              "--eval" (format nil "(bench-peer:serve ~D ~D~@[ :workers ~D~]~@[ :page-file ~S~])"
                                               port delay-ms workers (and page-file (namestring page-file)))))
                       :environment (peer-environment peer)
                       :output log-file :error-output :output :if-output-exists :supersede))

(defun measures-workload-p (server workload)
  "True when SERVER is measured on WORKLOAD: a peer on the handler workloads
only, a server that differs only in how its handler waits on the workloads
whose handler waits only."
  (and (or (not (getf server :peer)) (null (getf workload :file)))
       (or (not (getf server :waits-only)) (plusp (getf workload :delay-ms)))))
