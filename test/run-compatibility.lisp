;;;; The compatibility suite (test/compatibility.lisp, test/confidence-
;;;; script.lisp), in a process of its own: it loads easy-routes,
;;;; hunchensocket and Clack's Hunchentoot handler from VENDOR (default
;;;; ../shared/vendor beside this checkout), and bordeaux-threads 0.9.4 with
;;;; them, which Clack needs and Debian does not have.  Prints
;;;; "compatibility: N passed, M failed" and writes "N M" to the file
;;;; COUNTS_FILE names, when it is set; exit 0 only when none failed.

(load (merge-pathnames "../tools/setup.lisp" *load-truename*))

(defparameter *vendor*
  (uiop:ensure-directory-pathname
   (or (uiop:getenv "VENDOR")
       (merge-pathnames "../../shared/vendor/" (uiop:pathname-directory-pathname *load-truename*)))))

(defparameter *vendor-folders*
  '("easy-routes/" "cl-routes/" "hunchensocket/" "sha1/" "clack/" "bordeaux-threads-0.9.4/")
  "The folders of VENDOR the suite loads systems from.")

(let ((missing (remove-if (lambda (folder) (probe-file (merge-pathnames folder *vendor*))) *vendor-folders*)))
  (when missing
    (format t "~&compatibility: not run: ~A lacks ~{~A~^, ~} (unchanged copies of easy-routes, cl-routes, ~
               hunchensocket, sha1, clack and bordeaux-threads 0.9.4; set VENDOR to their folder)~%"
            *vendor* missing)
    (uiop:quit 3)))

;; test/confidence-script.lisp finds Hunchentoot 1.3.1's test folder there.
(setf (uiop:getenv "VENDOR") (namestring *vendor*))

(apply #'find-systems-in (mapcar (lambda (folder) (merge-pathnames folder *vendor*)) *vendor-folders*))
(load-systems-quietly "hunchentoot-recycling-taskmaster/compatibility")
(multiple-value-bind (all-passed passed failed)
    (uiop:symbol-call '#:hunchentoot-recycling-taskmaster-test '#:run-tests "COMPATIBILITY" "compatibility")
  (let ((counts-file (uiop:getenv "COUNTS_FILE")))
    (when (and counts-file (plusp (length counts-file)))
      (with-open-file (out counts-file :direction :output :if-exists :supersede)
        (format out "~D ~D~%" passed failed))))
  (finish-output)
  (uiop:quit (if all-passed 0 1) nil))
